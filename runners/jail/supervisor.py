"""The jail's supervisor: the child's parent, outside its PID namespace and out of its reach.

    python -s -m runners.jail PLAN_JSON REPORT_FD JUDGE_PID   (started by the judge)

It starts the jailed child (a fork into a new PID namespace, which then builds its
walls: `runners.jail.enter`), receives the listener of the child's system-call filter
and answers every call the filter hands it: refusing the ones the plan does not allow
and letting the others through. What it saw goes to the judge, one JSON object a line
on a pipe only the supervisor holds:

    {"pid": 12345}                          the jailed worker, as the judge's /proc names it
    {"refused": "socket(AF_INET, …)"}      a call it refused
    {"ran": "/usr/bin/ptxas"}               a program it let start
    {"jail_error": "mount …: EPERM"}        the jail could not be built; the child ended
    {"network": "closed"}                   no IP socket opens from now on (below)

The child cannot forge these lines (it never holds the pipe), hide a refused call (the
kernel hands every one over before it runs) or outlive the supervisor: the kernel ends a
PID namespace with its first process, and that process dies with the supervisor.
When the child ends, the supervisor exits the same way (same status, same signal).

A collective group's jail (`Plan.loopback`) may open IP sockets on its own loopback,
where its ranks' process group connects, until the judge sends the supervisor
SIGUSR1 (CLOSE_NETWORK): the group is set up, and from then on any IP or routing
socket is refused and named. A process group made after that (which connects anew)
cannot start, and what the existing connections carry shows in the jail's network
counters, which the judge reads from outside (runners.harness.observe).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import select
import signal
import socket
import struct
import sys
from typing import NoReturn

from runners.jail import enter
from runners.jail import filter as syscall_filter
from runners.jail.plan import Plan

CLONE_NEWPID = 0x20000000
# From the judge: the collective group is set up, no new network sockets from now on.
CLOSE_NETWORK = signal.SIGUSR1
_PR_SET_PDEATHSIG = 1
_ADDR_NO_RANDOMIZE = 0x0040000

_NOTIF = struct.Struct("<QIIiIQ6Q")  # struct seccomp_notif
_RESPONSE = struct.Struct("<QqiI")  # struct seccomp_notif_resp
_IOCTL_RECV = 0xC0502100
_IOCTL_SEND = 0xC0182101
_IOCTL_ID_VALID = 0x40082102
_FLAG_CONTINUE = 1
_AT_FDCWD = -100
_PATH_MAX = 4096
_IP_FAMILIES = (2, 10)  # AF_INET, AF_INET6
_AF_NETLINK, _NETLINK_ROUTE = 16, 0
_SOCKET_FAMILIES = {1: "AF_UNIX", 2: "AF_INET", 10: "AF_INET6", 16: "AF_NETLINK", 17: "AF_PACKET"}

# For each call that writes by name: (dirfd argument or None, path argument), per path.
_WRITTEN_PATHS: dict[str, tuple[tuple[int | None, int], ...]] = {
    "open": ((None, 0),), "creat": ((None, 0),), "truncate": ((None, 0),),
    "mkdir": ((None, 0),), "rmdir": ((None, 0),), "unlink": ((None, 0),),
    "mknod": ((None, 0),), "rename": ((None, 0), (None, 1)), "link": ((None, 1),),
    "symlink": ((None, 1),), "openat": ((0, 1),), "mkdirat": ((0, 1),),
    "unlinkat": ((0, 1),), "mknodat": ((0, 1),), "renameat": ((0, 1), (2, 3)),
    "renameat2": ((0, 1), (2, 3)), "linkat": ((2, 3),), "symlinkat": ((1, 2),),
}


# A decision that the call was made here, on the caller's behalf: it returns 0.
DONE = (False, 0)


def _signed32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value & 0x80000000 else value


class Supervisor:
    def __init__(self, plan: Plan, report: int, worker: int) -> None:
        self.plan = plan
        self.report = report
        self.worker = worker
        self.worker_started = False
        # Cores it may ask for: any of the start's until it has narrowed itself to its
        # own, and from then on only those (runners.jail.plan.Plan.start_cpus).
        self.narrowed = False
        # A collective group's first process starts its peers, once each, first thing.
        self.ranks_to_start = plan.ranks - 1
        self.network_closed = False

    def close_network(self, *_: object) -> None:
        """The judge's CLOSE_NETWORK: refuse every network socket from now on, and say so
        (the judge waits for the word before the candidate's first call)."""
        self.network_closed = True
        self.say(network="closed")

    def say(self, **fields: object) -> None:
        try:
            os.write(self.report, (json.dumps(fields) + "\n").encode())
        except OSError:
            pass  # the judge is gone; the child will be too

    # -- reading the caller ---------------------------------------------------------

    def _string(self, pid: int, address: int) -> str | None:
        """A NUL-terminated string in the caller's memory, or None if unreadable."""
        if not address:
            return None
        try:
            fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
        except OSError:
            return None
        try:
            data = b""
            while len(data) < _PATH_MAX:
                chunk = 4096 - (address + len(data)) % 4096
                piece = os.pread(fd, chunk, address + len(data))
                if not piece:
                    return None
                end = piece.find(b"\0")
                if end >= 0:
                    return os.fsdecode(data + piece[:end])
                data += piece
            return None
        except OSError:
            return None
        finally:
            os.close(fd)

    def _resolved(self, pid: int, dirfd: int | None, path: str) -> str | None:
        """The path as the caller named it, made absolute without following links (the
        jail shows every path it binds at its own place, so the text is the place)."""
        if not path.startswith("/"):
            base_link = (f"/proc/{pid}/cwd" if dirfd is None or _signed32(dirfd) == _AT_FDCWD
                         else f"/proc/{pid}/fd/{_signed32(dirfd)}")
            try:
                path = os.path.join(os.readlink(base_link), path)
            except OSError:
                return None
        return os.path.normpath(path)

    def _followed(self, pid: int, path: str) -> str:
        """The path with the links the candidate made along it followed, in the jail's
        view: a link in its scratch folder to a /proc descriptor link is that descriptor.
        (A link swapped in after this check is not seen; what the descriptor refers to is
        sealed against writing, runners.harness.arena.)"""
        root = f"/proc/{pid}/root"
        # Only where it can make links: everywhere else they are the system's, read-only.
        places = [place.rstrip("/") for place in (self.plan.scratch, "/dev/shm")]  # nosec B108
        for _ in range(40):
            parts = path.strip("/").split("/")
            for end in range(1, len(parts) + 1):
                prefix = "/" + "/".join(parts[:end])
                if not any(prefix.startswith(place + "/") for place in places):
                    continue
                try:
                    target = os.readlink(root + prefix)
                except OSError:
                    continue  # not a link, or not there
                rest = "/".join(parts[end:])
                base = target if target.startswith("/") else os.path.join(os.path.dirname(prefix), target)
                path = os.path.normpath(os.path.join(base, rest) if rest else base)
                break
            else:
                return path
        return path

    def _writable(self, path: str) -> bool:
        """Its scratch folder, the devices it was given (a GPU's open read-write), and
        /proc files of its own processes (thread names, its own limits), which name no
        one outside its PID namespace."""
        parts = path.split("/")
        scratch = self.plan.scratch.rstrip("/")
        return (any(path == place or path.startswith(place.rstrip("/") + "/")
                    for place in [scratch, "/dev/shm", *self.plan.devices])  # nosec B108
                or (len(parts) > 3 and parts[1] == "proc"
                    and (parts[2] in ("self", "thread-self") or parts[2].isdigit())
                    # Not a descriptor reopened by its magic link, a thread's included:
                    # the judge hands some out read-only (the input file every child maps).
                    and not {"fd", "map_files"} & set(parts[3:]))
                # Harmless on a read-only /dev, and the GPU driver remakes its links there
                # at every start; the folders above the scratch folder (makedirs).
                or path.startswith("/dev/char/") or scratch.startswith(path.rstrip("/") + "/"))

    # -- deciding -------------------------------------------------------------------

    def decide(self, pid: int, number: int, args: tuple[int, ...]) -> tuple[bool, int]:
        """(let it through, errno otherwise) for one call; records what it refused. DONE:
        the supervisor made the call itself, and it returns 0."""
        name = syscall_filter.NAMES.get(number, f"system call {number}")
        if name == "clone" and args[0] & syscall_filter.CLONE_NEW_NAMESPACES:
            return self._refuse("clone with new namespaces (a way out of the jail)", errno.EPERM)
        if name in ("clone", *syscall_filter.PROCESS_STARTS):
            if self.plan.may_fork:
                return True, 0
            if pid == self.worker and self.ranks_to_start > 0:
                # The first process starting the group's other ranks, before it reads
                # anything from the judge: no candidate code exists yet.
                self.ranks_to_start -= 1
                return True, 0
            return self._refuse(f"starting a process ({name})", errno.EPERM)
        if name in syscall_filter.PROGRAM_STARTS:
            return self._program(pid, name, args)
        if name in ("socket", "socketpair") and self.plan.loopback and not self.network_closed and (
                args[0] & 0xFFFF in _IP_FAMILIES
                or (args[0] & 0xFFFF == _AF_NETLINK and args[2] == _NETLINK_ROUTE)):
            # The jail's own network namespace: its loopback, and the routing socket that
            # lists its interfaces (gloo looks its address up there); changing them takes
            # a capability the jailed identity lacks.
            return True, 0
        if name == "sched_setaffinity" and (mask := self._within_cores(pid, args)) is not None:
            return self._set_cores(pid, args[0], mask)
        if name in _WRITTEN_PATHS:
            for dirfd_index, path_index in _WRITTEN_PATHS[name]:
                text = self._string(pid, args[path_index])
                if text is None:
                    continue
                path = self._resolved(pid, None if dirfd_index is None else args[dirfd_index], text)
                if path is not None:
                    path = self._followed(pid, path)
                if path is not None and not self._writable(path):
                    return self._refuse(f"writing outside its directory: {path} ({name})", errno.EACCES)
            return True, 0
        return self._refuse(self._describe(pid, name, args), errno.EPERM)

    def _within_cores(self, pid: int, args: tuple[int, ...]) -> int | None:
        """The mask asked for, if it is within the cores it may have now (torch probes
        its cores one by one as it starts; the worker then narrows itself to its own)."""
        size, address = args[1], args[2]
        if not self.plan.cpus or not 0 < size <= 1024:
            return None
        try:
            fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
            try:
                mask = int.from_bytes(os.pread(fd, size, address), "little")
            finally:
                os.close(fd)
        except OSError:
            return None
        own = sum(1 << cpu for cpu in self.plan.cpus)
        start = sum(1 << cpu for cpu in (self.plan.start_cpus or self.plan.cpus))
        if mask == 0 or mask & ~(own if self.narrowed else start):
            return None
        # The worker narrows itself naming its own process (torch's probing as it is
        # imported names the calling thread, 0): from then on, no wider.
        if args[0] != 0 and mask & ~own == 0:
            self.narrowed = True
        return mask

    def _set_cores(self, pid: int, target: int, mask: int) -> tuple[bool, int]:
        """Sets the mask it read itself, and answers the call done: let through, the
        kernel would read the mask from the caller's memory again, after a thread of its
        could have widened it (a read of a page the caller had never touched shows it the
        moment to). `target` is a thread of the caller's, by its number in the jail."""
        task = pid if _signed32(target) == 0 else self._jail_task(pid, _signed32(target))
        if task is None:
            return False, errno.ESRCH
        try:
            os.sched_setaffinity(task, [cpu for cpu in range(mask.bit_length()) if mask >> cpu & 1])
        except OSError as error:
            return False, error.errno or errno.EINVAL
        return DONE

    @staticmethod
    def _jail_task(pid: int, number: int) -> int | None:
        """The thread of the caller's process numbered `number` in the jail, by its
        number in the supervisor's view (the last of its NSpid numbers is the jail's)."""
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return None
        for task in tasks:
            try:
                with open(f"/proc/{pid}/task/{task}/status", encoding="ascii", errors="replace") as handle:
                    line = next((line for line in handle if line.startswith("NSpid:")), "")
            except OSError:
                continue
            if line.split()[-1:] == [str(number)]:
                return int(task)
        return None

    def _program(self, pid: int, name: str, args: tuple[int, ...]) -> tuple[bool, int]:
        dirfd, path_index = (None, 0) if name == "execve" else (args[0], 1)
        text = self._string(pid, args[path_index])
        path = self._resolved(pid, dirfd, text) if text else None
        if not self.worker_started and pid == self.worker and path == self.plan.argv[0]:
            self.worker_started = True  # the jail becoming the worker: the one exec it owns
            return True, 0
        if path and not os.path.lexists(f"/proc/{pid}/root{path}"):
            return True, 0  # nothing there in its view (a PATH search): the kernel says so
        real = os.path.realpath(path) if path else None
        if real is not None and real in self.plan.programs and pid != self.worker:
            self.say(ran=path)
            return True, 0
        return self._refuse(f"starting a program: {path or '?'}", errno.EACCES)

    def _describe(self, pid: int, name: str, args: tuple[int, ...]) -> str:
        if name in ("socket", "socketpair"):
            family = _SOCKET_FAMILIES.get(args[0] & 0xFFFF, f"family {args[0] & 0xFFFF}")
            if self.network_closed:
                return (f"{name}({family}) once the group was set up: no new network "
                        "socket from then on (a process group made later needs them)")
            return f"{name}({family}): network access"
        if name in ("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp"):
            return f"{name}: reaching into another process"
        if name in ("mount", "umount2", "pivot_root", "chroot", "setns", "unshare"):
            return f"{name}: changing the jail's walls"
        if name in ("sched_setaffinity", "setpriority", "sched_setscheduler", "sched_setparam",
                    "sched_setattr"):
            return f"{name}: changing the cores or priority the harness set"
        return name

    def _refuse(self, what: str, code: int) -> tuple[bool, int]:
        self.say(refused=what)
        return False, code

    # -- the loop -------------------------------------------------------------------

    def answer(self, listener: int) -> None:
        """Receives one call from the filter and answers it."""
        buffer = bytearray(_NOTIF.size)
        try:
            fcntl.ioctl(listener, _IOCTL_RECV, buffer, True)
        except OSError:
            return  # the caller died meanwhile
        ident, pid, _flags, number, _arch, _ip, *args = _NOTIF.unpack(buffer)
        allowed, code = self.decide(pid, number, tuple(args))
        # What was read from the caller's memory is only good if the call is still the
        # one asked about.
        try:
            fcntl.ioctl(listener, _IOCTL_ID_VALID, struct.pack("<Q", ident))
        except OSError:
            return
        answer = (_RESPONSE.pack(ident, 0, 0, _FLAG_CONTINUE) if allowed
                  else _RESPONSE.pack(ident, 0, -code, 0))
        try:
            fcntl.ioctl(listener, _IOCTL_SEND, bytearray(answer), True)
        except OSError:
            pass

    def serve(self, listener: int | None) -> int:
        """Answers calls until the worker ends; returns its wait status. One thread: a
        process that made a new PID namespace for its children cannot start threads."""
        ended = os.pidfd_open(self.worker)
        poller = select.poll()
        poller.register(ended, select.POLLIN)
        if listener is not None:
            poller.register(listener, select.POLLIN)
        while True:
            for fd, event in poller.poll():
                if fd == ended:
                    return os.waitpid(self.worker, 0)[1]
                if event & (select.POLLHUP | select.POLLERR):
                    poller.unregister(fd)  # every process under the filter has ended
                elif event & select.POLLIN:
                    self.answer(fd)


def _exit_like(status: int) -> NoReturn:
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        if number not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
        os._exit(128 + number)
    os._exit(os.waitstatus_to_exitcode(status))


def main(argv: list[str]) -> NoReturn:
    plan, report, judge = Plan.from_json(argv[1]), int(argv[2]), int(argv[3])
    libc = ctypes.CDLL(None, use_errno=True)
    # The signal comes when the thread that started this process ends: the judge starts
    # children from the thread that runs the evaluation, and waits there.
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != judge:  # the judge died before the request took effect
        os._exit(1)
    # Where libraries and the heap land decides which code and data alias in the caches;
    # with randomisation off every child starts from one layout (the exec of the worker
    # inherits it).
    current = libc.personality(0xFFFFFFFF)
    if current >= 0 and not current & _ADDR_NO_RANDOMIZE:
        libc.personality(current | _ADDR_NO_RANDOMIZE)
    if libc.unshare(CLONE_NEWPID) != 0:
        code = ctypes.get_errno()
        os.write(report, (json.dumps({"jail_error": f"unshare(PID namespace): "
                                      f"{errno.errorcode.get(code, code)} ({os.strerror(code)})"})
                          + "\n").encode())
        os._exit(enter.EXIT_JAIL_FAILED)
    ours, theirs = socket.socketpair()
    worker = os.fork()
    if worker == 0:
        ours.close()
        enter.run(plan, theirs, report)
    theirs.close()
    # The request and reply pipes are the worker's alone: once it ends, the judge must
    # read the end of its channel, which it would not while this process held them.
    for fd in range(3, 1024):
        if fd not in (report, ours.fileno()):
            try:
                os.close(fd)
            except OSError:
                pass
    supervisor = Supervisor(plan, report, worker)
    signal.signal(CLOSE_NETWORK, supervisor.close_network)
    supervisor.say(pid=worker)
    try:
        _, fds, _, _ = socket.recv_fds(ours, 16, 1)
    except OSError:
        fds = []
    ours.close()
    _exit_like(supervisor.serve(fds[0] if fds else None))


if __name__ == "__main__":
    main(sys.argv)
