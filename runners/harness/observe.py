"""What the judge sees of a jailed worker from outside its process, and the one thing it does to it.

Nothing here asks the child anything: the kernel's own records of its processes
(/proc of the judge's PID namespace, and the jail's own /proc through the worker's root)
say how much CPU it used, how many threads it has, which cores and limits, and its memory
can be read while it is stopped. The judge keeps the whole jail stopped (SIGSTOP of its
process group, which no jailed process can leave: the filter refuses setsid and setpgid)
except while it answers a request, so no candidate code runs between requests, and
whatever a call returned is read before any of it can run again.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

# Stopped ('T'), stopped by a tracer ('t'), or gone ('Z', 'X'): none runs code.
_NOT_RUNNING = frozenset("tTZX")
STOP_TIMEOUT_S = 10.0
# Between two looks at a stopping jail: short against a call, long enough not to keep a
# core busy (the judge's thread may share one with other work).
_POLL_S = 20e-6
# How long the judge looks without sleeping for a worker to wait on its next request: an
# honest one does within microseconds of its reply.
_SPIN_S = 2e-3
# x86-64's read and readv (the only host the jail runs on): a worker waiting for its
# next request is in one of them on the request pipe (/proc/<pid>/syscall shows it).
_READS = (0, 19)


class StopFailed(Exception):
    """A jailed process kept running after it was told to stop."""


@dataclass(frozen=True)
class Settings:
    """The worker's scheduling settings as the kernel holds them."""

    threads: int
    cores: str  # Cpus_allowed_list, e.g. "1" or "2-3"; threads that differ after " | "
    nice: int
    limits: str  # /proc/<pid>/limits, the lines that differ between processes included

    def differences(self, before: Settings) -> list[str]:
        found = []
        if self.cores != before.cores:
            found.append(f"cores (the kernel's affinity): {before.cores} → {self.cores}")
        if self.nice != before.nice:
            found.append(f"nice (the kernel's priority): {before.nice} → {self.nice}")
        if self.limits != before.limits:
            found.append("resource limits (the kernel's): changed")
        return found


def _state(stat_text: str) -> str:
    return stat_text[stat_text.rindex(")") + 2]


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as handle:
            return handle.read()
    except OSError:
        return None


class Outside:
    """One jailed worker, by its process id in the judge's namespace (the jail's PID 1)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.stopped = False
        self._memory: int | None = None
        self._halted_at: float | None = None
        self._gone = False

    # -- the jail's processes ---------------------------------------------------------

    def _tasks(self) -> list[str]:
        """The /proc folder of every thread of every process in the jail: the worker's
        in the judge's /proc, the others' in the jail's own, through the worker's root."""
        jail_proc = f"/proc/{self.pid}/root/proc"
        try:
            members = [name for name in os.listdir(jail_proc) if name.isdigit() and name != "1"]
        except OSError:
            members = []
        found = []
        for folder in [f"/proc/{self.pid}"] + [f"{jail_proc}/{name}" for name in members]:
            try:
                found += [f"{folder}/task/{task}" for task in os.listdir(f"{folder}/task")]
            except OSError:
                continue
        return found

    @staticmethod
    def _at_rest(task: str) -> bool:
        """Stopped, and off its CPU: a thread is marked stopped just before it leaves the
        CPU, and the kernel adds its last stretch of CPU time only once it has."""
        stat = _read(f"{task}/stat")
        if stat is None:
            return True  # gone
        if _state(stat) not in _NOT_RUNNING:
            return False
        syscall = _read(f"{task}/syscall")
        return syscall is None or not syscall.startswith("running")

    def wait_reading(self, fd: int, limit_s: float) -> bool:
        """Waits until the worker's main thread is blocked reading descriptor `fd` (its
        next request), at most `limit_s`; False when that could not be seen. The judge's
        clock ends there, not when the reply came in: whatever the candidate does after
        writing its reply, before it waits for the next request, is on the clock."""
        blocked = tuple(f"{number} {fd:#x} " for number in _READS)
        started = time.perf_counter()
        while True:
            text = _read(f"/proc/{self.pid}/syscall")
            if text is None:
                return False  # gone, or /proc cannot show it here
            if text.startswith(blocked):
                return True
            waited = time.perf_counter() - started
            if waited > limit_s:
                return False
            if waited > _SPIN_S:
                time.sleep(_POLL_S)

    def halt(self) -> None:
        """Tells every process of the jail to stop, and returns at once: the judge sends it
        the moment the worker waits on its next request, and waits for it (`stop`) only
        after whatever else must happen straight after the reply (the GPU probe), so that
        no candidate code runs while the judge does that."""
        self._halted_at = time.perf_counter()
        try:
            os.killpg(self.pid, signal.SIGSTOP)
        except ProcessLookupError:
            self._gone = True

    def stop(self) -> float:
        """Stops every process of the jail (if `halt` has not already) and waits until no
        thread of it runs; returns the seconds since it was told to. The worker's reply
        came first, so the wait is for threads the candidate left running."""
        if self._halted_at is None:
            self.halt()
        started, self._halted_at = self._halted_at, None
        if self._gone:
            self.stopped = True
            return 0.0
        while True:
            tasks = self._tasks()
            if all(self._at_rest(task) for task in tasks):
                self.stopped = True
                return time.perf_counter() - started
            if time.perf_counter() - started > STOP_TIMEOUT_S:
                running = [line[:line.index(")") + 3] for task in tasks
                           if (line := _read(f"{task}/stat")) and not self._at_rest(task)]
                raise StopFailed(f"{len(running)} thread(s) of the jail were still running "
                                 f"{STOP_TIMEOUT_S:g} s after it was told to stop "
                                 f"({', '.join(running[:3])})")
            time.sleep(_POLL_S)

    def resume(self) -> None:
        self.stopped = False
        try:
            os.killpg(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    # -- accounting -------------------------------------------------------------------

    def cpu_ns(self) -> int:
        """CPU time of the jail's live threads, in nanoseconds (schedstat: exact once
        they are at rest)."""
        total = 0
        for task in self._tasks():
            text = _read(f"{task}/schedstat")
            if text:
                total += int(text.split()[0])
        return total

    def threads(self) -> int | None:
        """How many threads the worker has now: what the judge polls while a request
        runs (settings() reads every thread's cores too, which that poll does not need)."""
        status = _read(f"/proc/{self.pid}/status")
        if status is None:
            return None
        line = next((line for line in status.splitlines() if line.startswith("Threads:")), "")
        return int(line.partition(":")[2] or 0)

    def settings(self) -> Settings | None:
        status = _read(f"/proc/{self.pid}/status")
        stat = _read(f"/proc/{self.pid}/stat")
        limits = _read(f"/proc/{self.pid}/limits")
        if status is None or stat is None or limits is None:
            return None
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        nice = int(stat[stat.rindex(")") + 2:].split()[16])
        return Settings(threads=int(fields.get("Threads", "0")),
                        cores=self._cores(fields.get("Cpus_allowed_list", "").strip()),
                        nice=nice, limits=limits)

    def _cores(self, main: str) -> str:
        """Every thread's allowed cores, not only the main thread's (each has its own
        mask): the distinct lists, the main thread's first."""
        found = [main]
        try:
            tasks = os.listdir(f"/proc/{self.pid}/task")
        except OSError:
            tasks = []
        for task in tasks:
            status = _read(f"/proc/{self.pid}/task/{task}/status") or ""
            line = next((line for line in status.splitlines() if line.startswith("Cpus_allowed_list:")), "")
            cores = line.partition(":")[2].strip()
            if cores and cores not in found:
                found.append(cores)
        return " | ".join(found)

    # -- memory -----------------------------------------------------------------------

    def read(self, address: int, size: int) -> bytearray:
        """`size` bytes of the worker's memory at `address`; it must be stopped."""
        if not self.stopped:
            raise RuntimeError("the worker's memory is read only while it is stopped")
        if self._memory is None:
            self._memory = os.open(f"/proc/{self.pid}/mem", os.O_RDONLY)
        buffer = bytearray(size)
        view = memoryview(buffer)
        done = 0
        while done < size:
            count = os.preadv(self._memory, [view[done:]], address + done)
            if count <= 0:
                raise OSError(f"{size - done:,} bytes at {address + done:#x} cannot be read")
            done += count
        return buffer

    def close(self) -> None:
        if self._memory is not None:
            os.close(self._memory)
            self._memory = None


# The kernel's own counters of data sent through a network namespace's sockets, as
# (file under /proc/<pid>/net, line prefix, field): new TCP segments that carry data
# (not pure acknowledgements, which a transfer's peer may send a moment after it) and
# datagrams. A process in the namespace cannot reset them (that takes CAP_NET_ADMIN).
_DATA_SENT = (("netstat", "TcpExt", "TCPOrigDataSent"), ("snmp", "Udp", "OutDatagrams"),
              ("snmp", "UdpLite", "OutDatagrams"))


def network_data_sent(pid: int) -> int | None:
    """The TCP data segments and UDP datagrams the sockets of `pid`'s network namespace
    have sent since it was made, read from outside the process; None where /proc
    cannot show them (the process gone, or another user's namespace)."""
    tables: dict[str, dict[str, dict[str, str]]] = {}
    total = 0
    for file, prefix, name in _DATA_SENT:
        if file not in tables:
            text = _read(f"/proc/{pid}/net/{file}")
            if text is None:
                return None
            tables[file] = _counter_table(text)
        value = tables[file].get(prefix, {}).get(name)
        if value is None:
            if prefix == "TcpExt":
                return None  # no count of TCP data, the transport a process group uses
            continue
        total += int(value)
    return total


def _counter_table(text: str) -> dict[str, dict[str, str]]:
    """/proc/net/snmp's and netstat's layout: a line of names, then one of values, each
    line starting with the same prefix."""
    table: dict[str, dict[str, str]] = {}
    lines = text.splitlines()
    for names, values in zip(lines[::2], lines[1::2]):
        prefix, _, named = names.partition(":")
        if values.partition(":")[0] == prefix:
            table[prefix] = dict(zip(named.split(), values.partition(":")[2].split()))
    return table


class GpuProbe:
    """The judge's own work on a shared GPU, in its own CUDA context, around each call.

    `flush` evicts the L2 from the judge's side before a child is resumed: a child that
    skipped its own flush still starts cold. `idle_ms` times, on the judge's clock, a
    tiny kernel of the judge's and its completion right after a child was stopped:
    contexts of different processes take turns on the GPU, so work the child left
    running past its reply delays it, by however long that work still had to run.
    """

    def __init__(self) -> None:
        import torch

        self._torch = torch
        properties = torch.cuda.get_device_properties(torch.cuda.current_device())
        l2_bytes = getattr(properties, "L2_cache_size", 0) or 64 * 2**20
        self._flush = torch.empty(2 * l2_bytes, dtype=torch.uint8, device="cuda")
        self._tick = torch.zeros(1, device="cuda")

    def flush(self) -> None:
        self._flush.fill_(1)
        self._torch.cuda.synchronize()

    def idle_ms(self) -> float:
        started = time.perf_counter_ns()
        self._tick.add_(1)
        self._torch.cuda.synchronize()
        return (time.perf_counter_ns() - started) / 1e6
