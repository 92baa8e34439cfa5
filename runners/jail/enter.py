"""The child's side of the jail: build its walls, give up every privilege, then become the worker.

Runs in the first process of a new PID namespace (its PID 1), forked by the supervisor,
before any candidate code exists. In order:
1. new mount, network, IPC and UTS namespaces (the network's loopback up, for a
   collective group's ranks);
2. a root file system of its own: an empty tmpfs holding, read-only and at their own
   paths, the plan's readable paths and device nodes; a fresh /proc that shows only the
   jail's processes; its scratch folder, the only writable place; then pivot_root, so
   nothing else of the host is reachable;
3. its cores, limits and process group;
4. an unprivileged identity (when the judge is root), no new privileges;
5. the system-call filter, whose listener goes to the supervisor;
6. exec of the worker.
Any step that fails ends the process with a report the judge reads: a jail that cannot
be built is never run without.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import resource
import socket
import struct
from pathlib import Path
from typing import NoReturn

from runners.jail import filter as syscall_filter
from runners.jail.plan import Plan

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MNT_DETACH = 2
_NR_PIVOT_ROOT = 155
_PR_SET_PDEATHSIG = 1
_SIGKILL = 9
# Per-mount options as /proc/self/mountinfo shows them, and the flag each keeps.
_KEPT_OPTIONS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}
# Every thread and process of the child's identity counts: torch's pools, CUDA's and the
# compilers' fit far below this; a fork bomb does not.
NPROC = 4096

EXIT_JAIL_FAILED = 97


class JailError(Exception):
    """A step of building the jail failed: the child must not run."""


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                           ctypes.c_char_p]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    return libc


def _checked(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise JailError(f"{what}: {errno.errorcode.get(code, code)} ({os.strerror(code)})")


def _mount(libc: ctypes.CDLL, source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    _checked(libc.mount(source.encode() if source else None, target.encode(),
                        fstype.encode() if fstype else None, flags,
                        data.encode() if data else None),
             f"mount {source or fstype or ''} on {target}")


def _place(source: str, target: str) -> bool:
    """An empty file or folder at `target` to bind `source` on, or the same symlink.
    Returns False for a symlink (nothing to mount)."""
    if os.path.islink(source):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if not os.path.lexists(target):
            os.symlink(os.readlink(source), target)
        return False
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if not os.path.lexists(target):
            Path(target).touch()
    return True


def _bind(libc: ctypes.CDLL, source: str, target: str, *, writable: bool = False,
          devices: bool = False) -> None:
    if not _place(source, target):
        return
    _mount(libc, source, target, None, MS_BIND | MS_REC)
    flags = MS_BIND | MS_REMOUNT | MS_NOSUID | (0 if devices else MS_NODEV)
    _mount(libc, None, target, None, flags | (0 if writable else MS_RDONLY))


def _read_only_below(libc: ctypes.CDLL, root: str, writable: set[str]) -> None:
    """Submounts that came along with a recursive bind keep their own flags: make each
    read-only too, keeping the flags it had (noexec stays noexec)."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        point = fields[4].replace("\\040", " ")
        options = set(fields[5].split(","))
        if not point.startswith(root + "/") or point in writable or "ro" in options:
            continue
        if point.startswith(root + "/proc") or point.startswith(root + "/dev"):
            continue
        kept = sum(flag for name, flag in _KEPT_OPTIONS.items() if name in options)
        _mount(libc, None, point, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | kept)


def _build_root(libc: ctypes.CDLL, plan: Plan) -> None:
    root = plan.root
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
    _mount(libc, "tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=16m")
    bound: list[str] = []
    for path in sorted(plan.readable, key=lambda item: (item.count("/"), item)):
        if any(path.startswith(folder + "/") for folder in bound):
            continue  # already there, with the folder above it
        _bind(libc, path, root + path)
        if os.path.isdir(path) and not os.path.islink(path):
            bound.append(path.rstrip("/"))
    dev = root + "/dev"
    os.makedirs(dev, exist_ok=True)
    _mount(libc, "tmpfs", dev, "tmpfs", MS_NOSUID, "mode=0755,size=1m")
    for device in plan.devices:
        _bind(libc, device, root + device, writable=True, devices=True)
    # /dev/char/MAJOR:MINOR, as udev makes them: the GPU driver looks its nodes up there
    # and, where one is missing, tries to create it.
    os.makedirs(dev + "/char", exist_ok=True)
    for device in plan.devices:
        status = os.stat(device)
        if os.path.isdir(device) or not os.path.exists(device):
            continue
        name = f"{dev}/char/{os.major(status.st_rdev)}:{os.minor(status.st_rdev)}"
        if not os.path.lexists(name):
            os.symlink(os.path.relpath(device, "/dev/char"), name)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{dev}/{name}")
    # Shared memory lives in the scratch folder: the only place the child may write.
    shared = os.path.join(plan.scratch, "shm")
    os.makedirs(shared, exist_ok=True)
    _bind(libc, shared, dev + "/shm", writable=True)
    _mount(libc, None, dev, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID)
    os.makedirs(root + "/proc", exist_ok=True)
    _mount(libc, "proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.makedirs(root + "/tmp", exist_ok=True)  # nosec B108 - the jail's own, read-only /tmp
    _bind(libc, plan.scratch, root + plan.scratch, writable=True)
    for path in plan.hidden:
        if os.path.isdir(root + path):
            _mount(libc, "tmpfs", root + path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k")
    _read_only_below(libc, root, {root + plan.scratch, dev + "/shm"})
    _mount(libc, None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "mode=0755,size=16m")
    os.chdir(root)
    libc.syscall.restype = ctypes.c_long
    _checked(libc.syscall(ctypes.c_long(_NR_PIVOT_ROOT), b".", b"."), "pivot_root")
    _checked(libc.umount2(b".", MNT_DETACH), "detaching the host's root")
    os.chdir(plan.scratch)


_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1


def _loopback_up() -> None:
    """A new network namespace has only `lo`, down: a collective group's ranks talk
    over it (gloo's TCP pairs), and nothing else is there to reach."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(probe, _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(probe, _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))


def _own_scratch(plan: Plan) -> None:
    if plan.uid is None:
        return
    for folder, dirs, files in os.walk(plan.scratch):
        for name in [folder, *(os.path.join(folder, item) for item in dirs + files)]:
            os.lchown(name, plan.uid, plan.gid if plan.gid is not None else plan.uid)


def _limits(plan: Plan) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (plan.file_bytes, plan.file_bytes))
    # The soft limit sends SIGXCPU, which the judge reports; the hard one is a backstop.
    resource.setrlimit(resource.RLIMIT_CPU, (plan.cpu_seconds, plan.cpu_seconds + 5))
    resource.setrlimit(resource.RLIMIT_NPROC, (NPROC, NPROC))


def _give_up_privileges(libc: ctypes.CDLL, plan: Plan) -> None:
    if plan.uid is not None:
        gid = plan.gid if plan.gid is not None else plan.uid
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(plan.uid, plan.uid, plan.uid)
    # A change of identity clears the parent-death signal: ask again.
    _checked(libc.prctl(_PR_SET_PDEATHSIG, _SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")


def run(plan: Plan, supervisor: socket.socket, report: int) -> NoReturn:
    """Builds the jail around this process and execs the worker; never returns."""
    try:
        # The folders this builds are traversed by the unprivileged worker: under an
        # operator's umask 077 (the quick start's) they were its owner's alone, and the
        # worker could not even exec its interpreter.
        os.umask(0o022)
        libc = _libc()
        _checked(libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS),
                 "unshare(mount, network, IPC, UTS namespaces)")
        if plan.loopback:
            _loopback_up()
        _own_scratch(plan)
        _build_root(libc, plan)
        if plan.start_cpus or plan.cpus:
            os.sched_setaffinity(0, plan.start_cpus or plan.cpus)
        _limits(plan)
        # Its own process group: the judge stops and resumes the whole jail at once.
        os.setpgid(0, 0)
        _give_up_privileges(libc, plan)
        listener = syscall_filter.install(libc)
    except (JailError, OSError, ValueError) as error:
        os.write(report, (json.dumps({"jail_error": str(error)}) + "\n").encode())
        os._exit(EXIT_JAIL_FAILED)
    socket.send_fds(supervisor, [b"L"], [listener])
    os.close(listener)
    supervisor.close()
    os.close(report)
    os.execv(plan.argv[0], plan.argv)
