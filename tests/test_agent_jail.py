"""A hostile coding agent against its jail (research.agent_jail): every escape the probe
of tests/agents/scripted_agent.py tries is first shown to work when the agent runs as a
plain process, then to reach nothing when a worker runs it in a sweep. Real processes,
a real listening socket for the app's broker, real files outside the checkout."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from research import agent_jail, agents, queueing, sweeps
from tests.test_agents import AGENT, _command, _processes_with

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parent.parent


def _stop(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def outside(tmp_path):
    """What a hostile agent aims at: a folder of the worker's machine holding the app's
    database, a broker listening on loopback, and a process of the machine whose
    environment holds the app's secret key."""
    folder = tmp_path / "outside-the-checkout"
    folder.mkdir()
    (folder / "app.sqlite3").write_bytes(b"SQLite format 3\x00" + b"\x00" * 4080)
    broker = socket.create_server(("127.0.0.1", 0))
    holder = subprocess.Popen(["sleep", "120"], env={"SECRET_KEY": "the-app-secret", "PATH": "/usr/bin:/bin"})
    yield folder, broker.getsockname()[1]
    holder.kill()
    holder.wait()
    broker.close()
    _stop(_processes_with(folder.name))


def _plain_checkout(tmp_path: Path) -> Path:
    """A git checkout with the rmsnorm kernel and a context file, as a sweep makes one."""
    checkout = tmp_path / "plain"
    kernel = checkout / "kernels" / "rmsnorm" / "cpu" / "kept.py"
    kernel.parent.mkdir(parents=True)
    shutil.copy(ROOT / "runners" / "ops" / "rmsnorm" / "kernels" / "blocked.py", kernel)
    (checkout / "KERNEL_LAB_CONTEXT.md").write_text("# context\n\n## Forbidden tricks\n")
    subprocess.run(["git", "init", "-q", str(checkout)], check=True)
    return checkout


def test_outside_a_jail_the_probe_reaches_the_secret_the_database_the_broker_and_the_disk(tmp_path, outside):
    folder, port = outside
    checkout = _plain_checkout(tmp_path)
    # The worker's environment less the servers' addresses, as agents were once given.
    env = {key: value for key, value in os.environ.items() if key not in ("DATABASE_URL", "REDIS_URL")}
    env.update(SECRET_KEY="the-app-secret", KERNEL_LAB_CONTEXT="KERNEL_LAB_CONTEXT.md",
               KERNEL_LAB_KERNEL="kernels/rmsnorm/cpu/kept.py")
    done = subprocess.run([sys.executable, str(AGENT), f"probe:{port}:{folder}"], cwd=checkout, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    report = (checkout / "kernels" / "rmsnorm" / "cpu" / "kept.py").read_text()
    for found in ("secret in its environment", "/environ", "read the database (4096 bytes)",
                  "reached the broker", "wrote outside its checkout", "planted core.fsmonitor"):
        assert found in report
    assert (folder / "written-by-agent").exists()
    helpers = _processes_with(folder.name)
    assert helpers, "the helper outlived the agent"
    _stop(helpers)
    # The worker's own git, run in that checkout, runs what the agent planted.
    subprocess.run(["git", "-C", str(checkout), "status", "--short"], capture_output=True, check=False)
    assert (folder / "fsmonitor-ran").exists()


def _propose(make_thesis, user, settings, modes: str, **thesis):
    settings.AGENT_COMMANDS = {"scripted": _command(modes)}
    settings.AGENT_TIME_LIMIT_S = 60
    sweep = sweeps.sweep_start(thesis=make_thesis(**thesis), started_by=user, kernel="blocked",
                                 strategy="agent", budget=1, agent_command="scripted")
    claimed, number = agents._proposal_claim(sweep_id=sweep.pk, task_id="jail")
    return agents.proposal_run(sweep=claimed, proposal_number=number)


@pytest.fixture
def quiet(monkeypatch):
    """No proposals are sent to a broker: the tests run them here."""
    monkeypatch.setattr(queueing, "proposal_enqueue", lambda sweep_id: None)


def test_in_its_jail_the_probe_reaches_nothing_and_leaves_nothing_running(make_thesis, user, settings, quiet,
                                                                          outside, monkeypatch):
    folder, port = outside
    monkeypatch.setenv("SECRET_KEY", "the-app-secret")  # the worker's own environment holds it
    proposal = _propose(make_thesis, user, settings, f"probe:{port}:{folder}")

    assert proposal.refusal == "" and proposal.files == ["kernels/rmsnorm/cpu/kept.py"]
    report = next(line for line in proposal.source.splitlines() if line.startswith("# probe:"))
    # Its own .git is its to write; nothing else it tried worked.
    assert report == "# probe: planted core.fsmonitor"
    assert not (folder / "written-by-agent").exists()
    assert not (folder / "fsmonitor-ran").exists()  # the change was read with a git directory it never saw
    assert not _processes_with(folder.name), "a helper outlived the agent's jail"


def test_an_agent_that_fills_the_disk_is_stopped_at_its_file_size_limit(make_thesis, user, settings, quiet, tmp_path):
    env = {key: value for key, value in os.environ.items() if key not in ("DATABASE_URL", "REDIS_URL")}
    env.update(KERNEL_LAB_CONTEXT="KERNEL_LAB_CONTEXT.md", KERNEL_LAB_KERNEL="kernels/rmsnorm/cpu/kept.py")
    checkout = _plain_checkout(tmp_path)
    outside = subprocess.run([sys.executable, str(AGENT), "fill:3"], cwd=checkout, env=env,
                             capture_output=True, text=True, timeout=60, check=False)
    assert outside.returncode == 0, outside.stderr  # unbounded, as a plain process
    assert (checkout / "kernels" / "rmsnorm" / "cpu" / "filler.bin").stat().st_size == 3 * 2**20

    settings.AGENT_MAX_FILE_BYTES = 2**20
    proposal = _propose(make_thesis, user, settings, "fill:3")
    assert proposal.refusal == f"the agent wrote a file past the limit of {2**20:,} bytes and was stopped"


def test_a_folder_above_the_kernel_replaced_by_a_link_is_not_followed(make_thesis, user, settings, quiet, tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "kept.py").write_text("SECRET = 'a file of the worker's machine'\n")
    proposal = _propose(make_thesis, user, settings, f"link:{target}", allowed_paths=["kernels/"])
    # Inside the jail the link points at a folder that does not exist there; the worker,
    # reading the checkout outside, must not follow it to the real one.
    assert proposal.refusal == "a folder above kernels/rmsnorm/cpu/kept.py was replaced by a symbolic link"
    assert "SECRET" not in proposal.source


def test_an_agent_runs_as_a_user_of_its_own_with_only_its_declared_environment(make_thesis, user, settings,
                                                                               quiet, monkeypatch):
    monkeypatch.setenv("SOME_CLOUD_TOKEN", "t0ken")
    monkeypatch.setenv("MODEL_API_KEY", "k3y")
    settings.AGENT_COMMANDS = {"scripted": {"command": _command("whoami"), "env": ["MODEL_API_KEY"]}}
    settings.AGENT_TIME_LIMIT_S = 60
    sweep = sweeps.sweep_start(thesis=make_thesis(), started_by=user, kernel="blocked", strategy="agent",
                                 budget=1, agent_command="scripted")
    claimed, number = agents._proposal_claim(sweep_id=sweep.pk, task_id="jail")
    proposal = agents.proposal_run(sweep=claimed, proposal_number=number)
    assert proposal.refusal == ""
    report = next(line for line in proposal.source.splitlines() if line.startswith("# whoami:"))
    uid = agent_jail.NOBODY if os.geteuid() == 0 else os.geteuid()
    assert f"uid={uid}" in report and "MODEL_API_KEY" in report and "SOME_CLOUD_TOKEN" not in report
    assert "pid=2" in report or "pid=1" in report  # the first processes of a namespace of its own


def _echo_server() -> socket.socket:
    """A stand-in for a model's API: answers every connection with what it was sent."""
    import threading

    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            with client:
                client.sendall(b"echo " + client.recv(64))

    threading.Thread(target=serve, daemon=True).start()
    return server


def test_a_networked_agent_reaches_its_declared_host_and_never_the_workers_loopback(
        make_thesis, user, settings, quiet, outside):
    """With `network = true` an agent shared the worker's network: it read the password
    hashes from PostgreSQL on 127.0.0.1 and made its user a superuser. Now it has only
    its own loopback, and a proxy to the hosts it declares."""
    _, broker = outside
    api = _echo_server()
    try:
        declared = api.getsockname()[1]
        # The stand-in listens on loopback, which the proxy would otherwise refuse (below).
        settings.AGENT_EGRESS_ALLOW_PRIVATE = True
        settings.AGENT_COMMANDS = {"scripted": {"command": _command(f"egress:{broker}:{declared}"),
                                                "hosts": [f"127.0.0.1:{declared}"]}}
        settings.AGENT_TIME_LIMIT_S = 60
        sweep = sweeps.sweep_start(thesis=make_thesis(), started_by=user, kernel="blocked",
                                     strategy="agent", budget=1, agent_command="scripted")
        claimed, number = agents._proposal_claim(sweep_id=sweep.pk, task_id="jail")
        proposal = agents.proposal_run(sweep=claimed, proposal_number=number)
    finally:
        api.close()
    assert proposal.refusal == "", proposal.refusal
    report = next(line for line in proposal.source.splitlines() if line.startswith("# egress:"))
    assert report == "# egress: broker directly: refused; broker through the proxy: 403; declared host: 200, then echo ping"


def test_the_egress_proxy_refuses_a_declared_host_that_resolves_to_loopback():
    """A declared name that resolves inside (localhost, a rebinding name) is no way in."""
    from research.agent_egress import Egress

    api = _echo_server()
    egress = Egress((f"localhost:{api.getsockname()[1]}",))
    try:
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(str(egress.socket_path))
            client.sendall(f"CONNECT localhost:{api.getsockname()[1]} HTTP/1.1\r\n\r\n".encode())
            answer = client.recv(4096).decode()
        assert answer.startswith("HTTP/1.1 403 ") and "loopback" in answer
        assert any("loopback" in refusal for refusal in egress.refusals)
    finally:
        egress.close()
        api.close()
    assert not egress.socket_path.exists()


@pytest.mark.parametrize(("value", "message"), [
    (["not", "a", "table"], "a command line or a table"),
    ({"command": "x", "network": True}, "name what it may reach instead"),
    ({"command": "x", "hosts": ["api.example.com"]}, "`hosts` must be a list of \"host:port\""),
    ({"command": "x", "hosts": ["api.example.com:99999"]}, "`hosts` must be a list"),
    ({"command": "x", "hosts": ["a b:443"]}, "`hosts` must be a list"),
    ({"command": "x", "netwrok": True}, "unknown keys netwrok"),
    ({"command": ""}, "`command` must be a non-empty string"),
    ({"command": "x", "read": ["relative/path"]}, "`read` must be a list of absolute paths"),
    ({"command": "x", "env": ["NOT-A-NAME"]}, "`env` must be a list of variable names"),
])
def test_a_declaration_that_is_not_one_is_refused_with_its_reason(value, message):
    with pytest.raises(agent_jail.JailError, match=message):
        agent_jail.declaration("bad", value)


def test_without_bubblewrap_the_agent_is_not_run(make_thesis, user, settings, quiet, monkeypatch):
    monkeypatch.setattr(agent_jail, "BWRAP", "bwrap-that-is-not-installed")
    proposal = _propose(make_thesis, user, settings, "improve")
    assert proposal.refusal.startswith("the agent was not run: bubblewrap is not installed")
    assert "apt install bubblewrap" in proposal.refusal
