"""Isolation: candidates run in child processes the judge questions over a private,
pickle-free channel; what they try is refused and recorded, and whatever they do, the
evaluation completes and the next one starts clean."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from runners.harness import Limits, evaluate, wire
from runners.harness.sandbox import Sandbox

LIMITS = Limits(import_s=2, call_s=2, memory_bytes=512 * 2**20)
ROOT = Path(__file__).resolve().parent.parent
CANDIDATES = ROOT / "tests" / "candidates"

RIGHT = """
import torch

def forward(x, weight, eps):
    hidden = x.float()
    rstd = torch.rsqrt(hidden.square().mean(dim=-1, keepdim=True) + eps)
    return (hidden * rstd * weight.float()).to(x.dtype)
"""


def _candidate(tmp_path, body: str) -> Path:
    path = tmp_path / "candidate.py"
    path.write_text(textwrap.dedent(body))
    return path


def _failing(result):
    return {guard.name: guard.detail for guard in result.guards if guard.status == "fail"}


def _worker_children(of: int | None = None) -> list[int]:
    """Processes still running the worker whose parent is this process (or `of`)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        parent = next((line.split()[1] for line in status.splitlines() if line.startswith("PPid:")), "")
        if parent == str(of or os.getpid()) and b"runners" in command and b"harness" in command:
            found.append(int(entry.name))
    return found


# -- the channel ------------------------------------------------------------------


@pytest.fixture
def channel():
    read, write = os.pipe()
    yield read, write
    for fd in (read, write):
        try:
            os.close(fd)
        except OSError:
            pass


def test_a_frame_carries_a_json_header_and_raw_tensors(channel):
    read, write = channel
    tensors = {"bf16": torch.randn(3, 5).to(torch.bfloat16), "idx": torch.arange(7),
               "empty": torch.empty(0, 4)}
    wire.write_message(write, {"ok": True, "ms": 0.25}, tensors)
    header, received = wire.read_message(read, deadline=time.monotonic() + 5, max_bytes=1 << 20)
    assert header == {"ok": True, "ms": 0.25}
    assert set(received) == set(tensors)
    for name, tensor in tensors.items():
        assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor)


def test_a_pickle_is_refused_as_garbage_and_never_run(channel, tmp_path):
    read, write = channel
    marker = tmp_path / "ran"

    class Exploit:
        def __reduce__(self):
            return (Path.touch, (marker,))

    payload = pickle.dumps(Exploit())
    os.write(write, len(payload).to_bytes(8, "big") + payload)
    with pytest.raises(wire.ProtocolError, match="not JSON"):
        wire.read_message(read, deadline=time.monotonic() + 5)
    assert not marker.exists()


def test_tensor_payloads_are_bounded_before_they_are_read(channel):
    read, write = channel
    header = json.dumps({"tensors": [{"name": "out", "dtype": "float32", "shape": [1 << 30]}]}).encode()
    os.write(write, len(header).to_bytes(8, "big") + header)
    with pytest.raises(wire.ProtocolError, match="at most 1,024 were expected"):
        wire.read_message(read, deadline=time.monotonic() + 5, max_bytes=1024)


@pytest.mark.parametrize("spec", [
    {"name": "out", "dtype": "object", "shape": [1]},
    {"name": "out", "dtype": "float32", "shape": [-1]},
    {"name": "out", "dtype": "float32", "shape": [1] * 9},
    {"name": "out", "dtype": "float32", "shape": "everything"},
])
def test_malformed_tensor_descriptions_are_refused(channel, spec):
    read, write = channel
    header = json.dumps({"tensors": [spec]}).encode()
    os.write(write, len(header).to_bytes(8, "big") + header)
    with pytest.raises(wire.ProtocolError):
        wire.read_message(read, deadline=time.monotonic() + 5, max_bytes=1 << 20)


def test_oversized_headers_are_refused_unread(channel):
    read, write = channel
    os.write(write, (wire.MAX_HEADER_BYTES + 1).to_bytes(8, "big"))
    with pytest.raises(wire.ProtocolError, match="a header of"):
        wire.read_message(read, deadline=time.monotonic() + 5)


def test_silence_times_out_and_a_closed_end_is_told_apart(channel):
    read, write = channel
    with pytest.raises(wire.ChannelTimeout):
        wire.read_message(read, deadline=time.monotonic() + 0.05)
    os.close(write)
    with pytest.raises(wire.ChannelClosed):
        wire.read_message(read, deadline=time.monotonic() + 5)


# -- the sandbox's decisions --------------------------------------------------------


@pytest.fixture
def box(tmp_path):
    compiler = tmp_path / "bin" / "ptxas"
    compiler.parent.mkdir()
    compiler.write_text("")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    return Sandbox(scratch, frozenset({os.path.realpath(compiler)})), scratch, compiler


@pytest.mark.parametrize(("event", "args", "refused"), [
    ("open", ("/etc/hostname", "r", os.O_RDONLY), None),
    ("open", ("/tmp/elsewhere.txt", "w", os.O_WRONLY | os.O_CREAT), "writing outside its directory"),
    ("open", ("/tmp/elsewhere.txt", None, os.O_RDWR), "writing outside its directory"),
    ("open", (os.devnull, "w", os.O_WRONLY), None),
    ("open", (f"/proc/{os.getppid()}/mem", "rb", os.O_RDONLY), "reading another process's"),
    ("open", (3, "w", os.O_WRONLY), None),
    ("socket.connect", (None, ("127.0.0.1", 80)), "network access"),
    ("socket.getaddrinfo", ("example.org", 443, 0, 0, 0), "network access"),
    ("subprocess.Popen", ("/bin/sh", ["/bin/sh", "-c", "true"], None, None), "starting a program"),
    ("os.system", (b"true",), "os.system"),
    ("os.fork", (), "os.fork"),
    ("os.kill", (os.getppid(), 9), "signalling process"),
    ("os.kill", (os.getpid(), 0), None),
    ("ctypes.dlsym", (None, "system"), "looking up the native function 'system'"),
    ("ctypes.dlsym", (None, "cudaDeviceSetLimit"), None),
    ("os.rename", ("/tmp/a", "/tmp/b", None, None), "os.rename outside its directory"),
    ("shutil.rmtree", ("/", None), "shutil.rmtree outside its directory"),
])
def test_the_sandbox_refuses_what_a_candidate_has_no_business_doing(box, event, args, refused):
    sandbox, _, _ = box
    reason = sandbox._refusal(event, args)
    if refused is None:
        assert reason is None
    else:
        assert refused in reason


def test_the_sandbox_lets_a_dsl_start_its_own_compiler_and_write_its_own_directory(box):
    sandbox, scratch, compiler = box
    assert sandbox._refusal("subprocess.Popen", (str(compiler), [str(compiler), "--version"], None, None)) is None
    assert sandbox._refusal("open", (str(scratch / "cache" / "kernel.cubin"), "wb", os.O_WRONLY)) is None
    assert sandbox._refusal("os.rename", (str(scratch / "a"), str(scratch / "b"), None, None)) is None
    escape = scratch / "link"
    escape.symlink_to("/tmp")
    assert "outside" in sandbox._refusal("open", (str(escape / "x"), "w", os.O_WRONLY))


# -- processes ---------------------------------------------------------------------


def test_a_hang_is_killed_and_the_next_evaluation_starts_clean(tmp_path):
    hung = evaluate("rmsnorm", CANDIDATES / "rmsnorm_hang.py", context_lengths=[64],
                    time_budget_s=0.05, limits=LIMITS)
    assert _failing(hung)["process"].endswith("within 2 s; it was killed")
    assert _worker_children() == []
    after = evaluate("rmsnorm", _candidate(tmp_path, RIGHT), context_lengths=[64],
                     time_budget_s=0.05, limits=LIMITS)
    assert after.verdict == "no-gain" and after.correct is True
    assert _worker_children() == []


def test_the_judge_never_imports_the_candidate(tmp_path):
    # Tests that load the project's own kernels in this process may have come first.
    before = {name for name in sys.modules if name.startswith("_candidate_")}
    evaluate("rmsnorm", _candidate(tmp_path, RIGHT), context_lengths=[64], time_budget_s=0.02,
             limits=LIMITS)
    assert not [name for name in sys.modules if name.startswith("_candidate_") and name not in before]


def test_a_child_sees_a_clean_environment_rooted_in_its_own_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNEL_LAB_TEST_SECRET", "not for candidates")
    result = evaluate("rmsnorm", _candidate(tmp_path, RIGHT + textwrap.dedent("""
        import os
        here = os.getcwd()
        assert "KERNEL_LAB_TEST_SECRET" not in os.environ, "the judge's environment leaked"
        for name in ("HOME", "TMPDIR", "TRITON_CACHE_DIR", "TORCH_EXTENSIONS_DIR"):
            assert os.environ[name].startswith(here), name
    """)), context_lengths=[64], time_budget_s=0.02, limits=LIMITS)
    assert result.correct is True, _failing(result)


def test_a_forged_frame_on_the_result_channel_breaks_the_protocol_and_rejects(tmp_path):
    # The reply descriptor is on the child's command line; a candidate can find it.
    result = evaluate("rmsnorm", _candidate(tmp_path, RIGHT + textwrap.dedent("""
        import json, os, sys
        _real = forward

        def forward(x, weight, eps):
            fake = json.dumps({"ok": True, "ms": 0.001, "seq": 999}).encode()
            os.write(int(sys.argv[2]), len(fake).to_bytes(8, "big") + fake)
            return _real(x, weight, eps)
    """)), context_lengths=[64], time_budget_s=0.02, limits=LIMITS)
    assert result.verdict == "rejected"
    assert "broke the result protocol" in _failing(result)["protocol"]


def test_a_child_cannot_hide_a_change_to_its_inputs_the_judge_reads_them_itself(tmp_path):
    # Every comparison it could reach in its own process is silenced; the judge reads the
    # inputs from the stopped child's memory and compares them with its own copy.
    result = evaluate("rmsnorm", _candidate(tmp_path, RIGHT + textwrap.dedent("""
        torch.equal = lambda a, b: True
        torch.Tensor.__eq__ = lambda a, b: torch.zeros((), dtype=torch.bool)
        _real = forward

        def forward(x, weight, eps):
            out = _real(x, weight, eps)
            x.add_(1)
            return out
    """)), context_lengths=[64], time_budget_s=0.02, limits=LIMITS,
        # Its patches of torch are in its source, which stops it first; the judge's own
        # reading of the inputs is shown as if they had been hidden.
        stop_at_static=False)
    assert "65,536 of 65,536 elements of x differ" in _failing(result)["inputs-unchanged"]


def test_children_die_with_the_judge():
    # The worker's time limit kills the judge, not the children in their own sessions.
    judge = subprocess.Popen(
        [sys.executable, "-m", "runners.harness", "evaluate", "rmsnorm",
         str(CANDIDATES / "rmsnorm_hang.py"), "--ctx", "64", "--json"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while not (workers := _worker_children(of=judge.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert workers, "the judge never started a child"
    finally:
        judge.kill()
        judge.wait()
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(Path(f"/proc/{pid}").exists() for pid in workers)


def test_the_input_file_every_child_maps_is_read_only_to_the_children():
    """The candidate and the baselines map one file: the children's descriptor refuses
    every way of changing it, and another user cannot reopen it for writing."""
    import errno
    import mmap

    from runners.harness import arena

    inputs = arena.Arena(1 << 16)
    try:
        fd = inputs.child_fd
        view = mmap.mmap(fd, inputs.capacity, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
        view[0:4] = b"mine"  # a child's own copy of the page, as before
        assert os.pread(inputs.fd, 4, 0) == b"\0\0\0\0"
        for change in (lambda: os.pwrite(fd, b"x", 0), lambda: os.ftruncate(fd, 0),
                       lambda: os.posix_fallocate(fd, 0, 4096)):
            with pytest.raises(OSError) as refused:
                change()
            assert refused.value.errno in (errno.EBADF, errno.EINVAL, errno.EPERM)
        with pytest.raises(PermissionError):
            os.ftruncate(inputs.fd, 0)  # sealed: not even the judge's own descriptor shrinks it
        reopened = os.open(f"/proc/self/fd/{inputs.fd}", os.O_RDWR)  # its owner may reopen it...
        try:
            with pytest.raises(PermissionError):
                os.pwrite(reopened, b"x", 0)  # ... and still not write it: sealed against writes
            with pytest.raises(PermissionError):
                mmap.mmap(reopened, inputs.capacity, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(reopened)
        if os.geteuid() == 0:
            child = os.fork()
            if child == 0:
                os.setresuid(65534, 65534, 65534)
                try:
                    os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
                    os._exit(1)
                except PermissionError:
                    os._exit(0)
            assert os.waitpid(child, 0)[1] == 0, "another user reopened the input file for writing"
    finally:
        inputs.close()


# Widens its cores by racing the jail's check: the supervisor reads the mask from the
# caller's memory, and a mask in a page the caller never touched shows (in pagemap) the
# moment it was read; a helper thread then writes the wide mask there. Let through, the
# kernel read the mask again and took the wide one (1-3 tries on this machine); the
# supervisor now sets the mask it read itself. The import fails if the race was won.
_RACES_THE_AFFINITY_CHECK = """
    import ctypes, mmap, os, struct, threading, time
    import torch

    own = os.sched_getaffinity(0)
    wide = set(range(os.cpu_count()))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.sched_setaffinity.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p]
    pagemap = os.open("/proc/self/pagemap", os.O_RDONLY)

    def present(address):
        raw = os.pread(pagemap, 8, (address // 4096) * 8)
        return len(raw) == 8 and struct.unpack("<Q", raw)[0] >> 63

    for attempt in range(100):
        with open(f"mask{attempt}", "wb") as handle:
            handle.write(struct.pack("<Q", sum(1 << cpu for cpu in own)) + bytes(4088))
        fd = os.open(f"mask{attempt}", os.O_RDWR)
        page = mmap.mmap(fd, 4096, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
        address = ctypes.addressof(ctypes.c_char.from_buffer(page))
        done = [False]

        def flip():
            end = time.monotonic() + 0.05
            while not done[0] and time.monotonic() < end:
                if present(address):
                    page[0:8] = struct.pack("<Q", sum(1 << cpu for cpu in wide))
                    return

        helper = threading.Thread(target=flip)
        helper.start()
        libc.sched_setaffinity(0, 8, address)
        done[0] = True
        helper.join()
        if os.sched_getaffinity(0) - own:
            raise RuntimeError(f"won the race on attempt {attempt}: {sorted(os.sched_getaffinity(0))}")

    def forward(x, weight, eps):
        hidden = x.float()
        rstd = torch.rsqrt(hidden.square().mean(dim=-1, keepdim=True) + eps)
        return (hidden * rstd * weight.float()).to(x.dtype)
"""


def test_a_race_on_the_affinity_check_gains_no_core(tmp_path):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.fail("this machine has one core: the race needs a core to take")
    result = evaluate("rmsnorm", _candidate(tmp_path, _RACES_THE_AFFINITY_CHECK), context_lengths=[64],
                      time_budget_s=0.2, limits=Limits(import_s=60, call_s=20, memory_bytes=1024 * 2**20))
    loads = next(guard for guard in result.guards if guard.name == "loads")
    assert loads.status == "pass", loads.detail  # it never had the wide mask
    # A try whose wide mask the supervisor read in time is refused, and named.
    assert "sched_setaffinity" in _failing(result).get("jail", "sched_setaffinity"), _failing(result)
    assert "config" not in _failing(result), _failing(result)


def _process_state(pid: int) -> str | None:
    """The state letter of a process (Z: exited, not yet reaped), or None when gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def test_a_child_has_exited_when_it_is_closed_and_its_memory_is_free(tmp_path, monkeypatch):
    # A worker holding much memory takes a while to exit after its SIGKILL, longer than
    # its supervisor does; on a GPU the next evaluation's children then found most of
    # the device still held (cuMemCreate out of memory). close() waits for the worker.
    from runners.harness import children

    closed = []
    original = children.Child.close

    def recording(child):
        pid = child.worker_pid
        original(child)
        closed.append((pid, _process_state(pid)))

    monkeypatch.setattr(children.Child, "close", recording)
    heavy = _candidate(tmp_path, RIGHT + "\nHELD = torch.ones(200 * 2**20)  # 800 MB, touched\n")
    result = evaluate("rmsnorm", heavy, context_lengths=[64], time_budget_s=0.02,
                      limits=Limits(import_s=20, call_s=5, memory_bytes=1536 * 2**20))
    assert result.correct is True
    assert len(closed) >= 3 and all(pid is not None for pid, _ in closed)
    assert [state for _, state in closed if state not in (None, "Z")] == []


def test_the_jail_works_under_an_operators_umask_077(tmp_path):
    """The quick start writes its data under umask 077; the jail's folders, made with it,
    were the judge's alone, and the unprivileged worker could not exec its interpreter
    (every candidate "exited with status 1 while starting")."""
    done = subprocess.run(
        [sys.executable, "-m", "runners.harness", "evaluate", "rmsnorm", "baseline", "--ctx", "64",
         "--batch", "1", "--time-budget", "0.1", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
        preexec_fn=lambda: os.umask(0o077))
    result = json.loads(done.stdout)
    assert result["verdict"] == "no-gain", [g for g in result["guards"] if g["status"] == "fail"]
