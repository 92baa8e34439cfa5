"""The system-call filter of a jailed child: a seccomp BPF program built here, in Python.

The filter is installed by the child itself as the last step before it runs the worker
(`runners.jail.enter`), and every process and thread it starts inherits it; no program
can remove a filter. It sorts each system call three ways:

- allowed outright: everything an interpreter, torch, CUDA and the DSL compilers need;
- answered by the kernel with an error: `clone3` and `openat2` (their arguments are in
  a struct a filter cannot read, so they get ENOSYS and libc falls back to `clone` and
  `openat`, which it can);
- handed to the supervisor (SECCOMP_RET_USER_NOTIF): the calls no kernel needs
  (ptrace, network sockets, mounts, namespaces, kernel modules, changing identity,
  priority or affinity…), every program start, every new process (as opposed to a
  thread), and every system call that writes a file by name. The supervisor is the child's parent
  outside its PID namespace (`runners.jail.supervisor`): it records each one, so the
  judge can name what the candidate tried, and refuses or lets it through.

x86-64 only: a call under another ABI (i386, x32) kills the process.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass

AUDIT_ARCH_X86_64 = 0xC000003E
_X32_BIT = 0x40000000

RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
RET_USER_NOTIF = 0x7FC00000
RET_ALLOW = 0x7FFF0000

# Classic BPF opcodes (linux/bpf_common.h).
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_JSET_K = 0x45
_RET_K = 0x06

_NR_OFFSET = 0
_ARCH_OFFSET = 4
_ARGS_OFFSET = 16

# x86-64 system-call numbers, by name (asm/unistd_64.h).
NUMBERS: dict[str, int] = {
    "open": 2, "socket": 41, "socketpair": 53, "clone": 56, "fork": 57, "vfork": 58,
    "execve": 59, "truncate": 76, "rename": 82, "mkdir": 83, "rmdir": 84, "creat": 85,
    "link": 86, "unlink": 87, "symlink": 88, "ptrace": 101, "setuid": 105, "setgid": 106,
    "setpgid": 109, "setsid": 112, "setreuid": 113, "setregid": 114, "setgroups": 116,
    "setresuid": 117, "setresgid": 119, "setfsuid": 122, "setfsgid": 123, "capset": 126,
    "mknod": 133, "uselib": 134, "personality": 135, "setpriority": 141,
    "sched_setparam": 142, "sched_setscheduler": 144, "vhangup": 153, "pivot_root": 155,
    "adjtimex": 159, "chroot": 161, "acct": 163, "settimeofday": 164, "mount": 165,
    "umount2": 166, "swapon": 167, "swapoff": 168, "reboot": 169, "sethostname": 170,
    "setdomainname": 171, "iopl": 172, "ioperm": 173, "init_module": 175,
    "delete_module": 176, "quotactl": 179, "sched_setaffinity": 203,
    "lookup_dcookie": 212, "clock_settime": 227, "kexec_load": 246, "add_key": 248,
    "request_key": 249, "keyctl": 250, "openat": 257, "mkdirat": 258, "mknodat": 259,
    "unlinkat": 263, "renameat": 264, "linkat": 265, "symlinkat": 266,
    "unshare": 272, "perf_event_open": 298, "fanotify_init": 300,
    "name_to_handle_at": 303, "open_by_handle_at": 304, "clock_adjtime": 305,
    "setns": 308, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312,
    "finit_module": 313, "sched_setattr": 314, "renameat2": 316, "kexec_file_load": 320,
    "bpf": 321, "execveat": 322, "userfaultfd": 323, "io_uring_setup": 425,
    "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428, "move_mount": 429,
    "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "clone3": 435,
    "openat2": 437, "pidfd_getfd": 438, "mount_setattr": 442,
}
NAMES = {number: name for name, number in NUMBERS.items()}

# Calls no kernel, compiler or interpreter needs, each refused (EPERM) and recorded:
# looking into or steering other processes, the network, the jail's own walls
# (mounts, namespaces, root), the kernel itself, the clock, and the identity,
# priority and cores the harness gave the process.
REFUSED = (
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "mount", "umount2", "pivot_root", "chroot", "setns", "unshare", "open_tree", "move_mount",
    "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr", "name_to_handle_at",
    "open_by_handle_at",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "bpf",
    "perf_event_open", "fanotify_init", "userfaultfd", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "add_key", "request_key", "keyctl", "lookup_dcookie", "quotactl",
    "uselib", "acct", "swapon", "swapoff", "reboot", "iopl", "ioperm", "vhangup",
    "sethostname", "setdomainname", "settimeofday", "clock_settime", "adjtimex",
    "clock_adjtime",
    "setuid", "setgid", "setreuid", "setregid", "setresuid", "setresgid", "setfsuid",
    "setfsgid", "setgroups", "capset", "personality",
    "setsid", "setpgid", "setpriority", "sched_setparam", "sched_setscheduler",
    "sched_setattr", "sched_setaffinity",
)
# Calls whose arguments a filter cannot read: refused with ENOSYS, and libc falls back
# to the older call, which the filter can read.
UNREADABLE = ("clone3", "openat2")
# Starting a program, and starting a process: the supervisor decides by the DSL's needs.
PROGRAM_STARTS = ("execve", "execveat")
PROCESS_STARTS = ("fork", "vfork")
# Calls that change the file system by name; open/openat/creat only when their flags
# write. The supervisor lets through those inside the child's own directory.
PATH_WRITES = ("truncate", "rename", "renameat", "renameat2", "mkdir", "mkdirat", "rmdir",
               "link", "linkat", "symlink", "symlinkat", "unlink", "unlinkat", "mknod",
               "mknodat")
# (call, index of its flags argument)
OPENS = (("open", 1), ("openat", 2), ("creat", None))

AF_UNIX = 1
O_WRITING = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
CLONE_THREAD = 0x00010000
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET: a new namespace is a
# way out of the one the jail made.
CLONE_NEW_NAMESPACES = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 \
    | 0x20000000 | 0x40000000


@dataclass(frozen=True)
class _Insn:
    code: int
    jt: int = 0
    jf: int = 0
    k: int = 0

    def pack(self) -> bytes:
        return struct.pack("<HBBI", self.code, self.jt, self.jf, self.k)


def _load_arg(index: int) -> _Insn:
    # The low 32 bits of the argument: every flag tested here lives there.
    return _Insn(_LD_W_ABS, k=_ARGS_OFFSET + 8 * index)


def _returns(action: int) -> _Insn:
    return _Insn(_RET_K, k=action)


def _block(number: int, body: list[_Insn]) -> list[_Insn]:
    """`if nr == number: body` where every path through body returns."""
    if len(body) > 255:
        raise ValueError("a filter block is too long for a BPF jump")
    return [_Insn(_JEQ_K, jt=0, jf=len(body), k=number), *body]


def _when_flags(arg: int, mask: int, then: int, otherwise: int) -> list[_Insn]:
    return [_load_arg(arg), _Insn(_JSET_K, jt=0, jf=1, k=mask), _returns(then), _returns(otherwise)]


def program() -> list[_Insn]:
    """The filter, as BPF instructions."""
    notify = RET_USER_NOTIF
    insns = [
        _Insn(_LD_W_ABS, k=_ARCH_OFFSET),
        _Insn(_JEQ_K, jt=1, jf=0, k=AUDIT_ARCH_X86_64),
        _returns(RET_KILL_PROCESS),
        _Insn(_LD_W_ABS, k=_NR_OFFSET),
        _Insn(_JGE_K, jt=0, jf=1, k=_X32_BIT),
        _returns(RET_KILL_PROCESS),
    ]
    for name in UNREADABLE:
        insns += _block(NUMBERS[name], [_returns(RET_ERRNO | errno.ENOSYS)])
    for name in REFUSED + PROGRAM_STARTS + PROCESS_STARTS + PATH_WRITES:
        insns += _block(NUMBERS[name], [_returns(notify)])
    # Sockets: a Unix socket stays in the jail (its abstract names are the network
    # namespace's own, and no socket file of the host is in its view; the GPU driver
    # opens one); any other family goes to the supervisor, which refuses it.
    for name in ("socket", "socketpair"):
        insns += _block(NUMBERS[name], [
            _load_arg(0), _Insn(_JEQ_K, jt=0, jf=1, k=AF_UNIX), _returns(RET_ALLOW), _returns(notify)])
    # clone: a new namespace or a new process goes to the supervisor; a thread does not.
    insns += _block(NUMBERS["clone"], [
        _load_arg(0),
        _Insn(_JSET_K, jt=2, jf=0, k=CLONE_NEW_NAMESPACES),
        _Insn(_JSET_K, jt=0, jf=1, k=CLONE_THREAD),
        _returns(RET_ALLOW),
        _returns(notify),
    ])
    for name, flags in OPENS:
        body = [_returns(notify)] if flags is None else _when_flags(flags, O_WRITING, notify, RET_ALLOW)
        insns += _block(NUMBERS[name], body)
    insns.append(_returns(RET_ALLOW))
    return insns


def watched(numbers: Iterable[int]) -> set[str]:
    return {NAMES.get(number, str(number)) for number in numbers}


# --- installing it ------------------------------------------------------------------

_SECCOMP_SET_MODE_FILTER = 1
_SECCOMP_FILTER_FLAG_NEW_LISTENER = 1 << 3
_NR_SECCOMP = 317
_PR_SET_NO_NEW_PRIVS = 38


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install(libc: ctypes.CDLL) -> int:
    """Installs the filter on this thread's process; returns the notification listener's
    descriptor, which the supervisor must receive before any watched call is made."""
    if os.uname().machine != "x86_64":
        raise OSError(errno.ENOSYS, f"the jail's system-call filter knows x86-64 only, not {os.uname().machine}")
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    code = b"".join(insn.pack() for insn in program())
    buffer = ctypes.create_string_buffer(code, len(code))
    fprog = _SockFprog(len(code) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    syscall = libc.syscall
    syscall.restype = ctypes.c_long
    listener = syscall(ctypes.c_long(_NR_SECCOMP), ctypes.c_long(_SECCOMP_SET_MODE_FILTER),
                       ctypes.c_long(_SECCOMP_FILTER_FLAG_NEW_LISTENER), ctypes.byref(fprog))
    if listener < 0:
        raise OSError(ctypes.get_errno(), "seccomp(SECCOMP_SET_MODE_FILTER)")
    return listener
