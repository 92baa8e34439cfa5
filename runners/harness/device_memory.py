"""GPU memory two processes share across the jail: CUDA virtual memory with a file descriptor.

On a GPU the judge writes a call's inputs, and reads its output, in the child's device
memory itself. The legacy CUDA IPC handles refuse processes in different PID namespaces,
so the child allocates with the driver's virtual-memory API (cuMemCreate) and exports
the allocation as a POSIX file descriptor; the judge takes a duplicate of that
descriptor out of the child (pidfd_getfd, which needs the judge's ptrace rights over
it) and maps the same memory into its own context. Nothing crosses the channel but a
descriptor number, and nothing of the candidate runs while the judge reads or writes:
the child is stopped.

Only the driver (libcuda) is used, through ctypes: no package beyond torch.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
from collections.abc import Mapping

import torch

_POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
_PINNED = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
_ON_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
_READ_WRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
_NR_PIDFD_GETFD = 438
_OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY


class DeviceMemoryError(OSError):
    """The driver refused a step of sharing device memory."""


class DeviceOutOfMemory(DeviceMemoryError, MemoryError):
    """The driver had no device memory left to give: a MemoryError, so that a child's
    failure reads as running out of memory (resources), not as its code raising."""


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", _Location), ("win32HandleMetaData", ctypes.c_void_p),
                ("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_driver: ctypes.CDLL | None = None


def _cuda() -> ctypes.CDLL:
    global _driver
    if _driver is None:
        _driver = ctypes.CDLL("libcuda.so.1")
    return _driver


def _checked(result: int, what: str) -> None:
    if result == _OUT_OF_MEMORY:
        raise DeviceOutOfMemory(f"{what} returned CUDA error {result}: out of memory")
    if result != 0:
        raise DeviceMemoryError(f"{what} returned CUDA error {result}")


def holders(names: Mapping[int, str]) -> str:
    """Who held the GPU's memory just now, by process as the driver counts it (through
    nvidia-smi, where it lists them), with what was free: said beside a failure for want
    of device memory, so that one run shows whether the judge, the kept kernel's
    processes or the candidate's took it. `names` labels the processes the judge knows
    (their PIDs as this process sees them). Never raises: it only adds to a guard."""
    try:
        free, total = torch.cuda.mem_get_info()
        room = f"{free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB"
    except RuntimeError as error:  # a context the failure left unusable
        room = f"what was free unknown ({error})"
    held = []
    try:
        listed = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                 "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
        lines = listed.stdout.splitlines() if listed.returncode == 0 else []
    except (OSError, subprocess.TimeoutExpired):
        lines = []
    for line in lines:
        pid, _, mib = (part.strip() for part in line.partition(","))
        if pid.isdigit() and mib.isdigit():
            held.append((int(mib), names.get(int(pid), f"process {pid}")))
    by_process = ", ".join(f"{name} {mib / 1024:.1f} GiB" for mib, name in sorted(held, reverse=True))
    judge = torch.cuda.memory_reserved() / 2**30
    return (f"device memory then: {by_process or 'no process listed by nvidia-smi'}; the judge's "
            f"allocator {judge:.1f} GiB; {room}")


def _prop(device: int) -> _AllocationProp:
    prop = _AllocationProp()
    prop.type = _PINNED
    prop.requestedHandleTypes = _POSIX_FD
    prop.location = _Location(_ON_DEVICE, device)
    return prop


class _Array:
    """A device pointer in the form torch.as_tensor takes without copying."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (address, False), "version": 3}


class DeviceInputs:
    """A child's side: the inputs of every call, on one shared allocation (like
    arena.Mapped on a CPU), which the judge rewrites while the child is stopped."""

    def __init__(self, capacity: int) -> None:
        self.memory, self.fd = Shared.create(capacity)

    def arguments(self, entries: list) -> tuple:
        return tuple(self.memory.tensor(_dtype(entry.dtype), entry.shape, entry.offset)
                     if entry.is_tensor else entry.value for entry in entries)


def _dtype(name: str) -> torch.dtype:
    from runners.harness.wire import DTYPES

    return DTYPES[name]


class Shared:
    """One allocation mapped into this process: `bytes` is it as a uint8 CUDA tensor."""

    def __init__(self, handle: int, size: int, device: int, exported: int | None = None) -> None:
        cuda = _cuda()
        self.size, self._handle = size, ctypes.c_ulonglong(handle)
        # The descriptor `create` exported: while it is open the driver keeps the memory,
        # released handle or not, so `close` closes it too.
        self._exported = exported
        self._address = ctypes.c_ulonglong(0)
        _checked(cuda.cuMemAddressReserve(ctypes.byref(self._address), ctypes.c_size_t(size),
                                          ctypes.c_size_t(0), ctypes.c_ulonglong(0),
                                          ctypes.c_ulonglong(0)), "cuMemAddressReserve")
        _checked(cuda.cuMemMap(self._address, ctypes.c_size_t(size), ctypes.c_size_t(0),
                               self._handle, ctypes.c_ulonglong(0)), "cuMemMap")
        access = _AccessDesc(_Location(_ON_DEVICE, device), _READ_WRITE)
        _checked(cuda.cuMemSetAccess(self._address, ctypes.c_size_t(size), ctypes.byref(access),
                                     ctypes.c_size_t(1)), "cuMemSetAccess")
        self.bytes = torch.as_tensor(_Array(self._address.value, size), device=f"cuda:{device}")

    @classmethod
    def create(cls, nbytes: int) -> tuple[Shared, int]:
        """A new allocation of at least `nbytes`, and a descriptor another process can map."""
        torch.zeros(1, device="cuda")  # the primary context current on this thread
        device = torch.cuda.current_device()
        cuda = _cuda()
        prop = _prop(device)
        granularity = ctypes.c_size_t(0)
        _checked(cuda.cuMemGetAllocationGranularity(ctypes.byref(granularity), ctypes.byref(prop),
                                                    ctypes.c_int(0)), "cuMemGetAllocationGranularity")
        size = max(granularity.value, -(-nbytes // granularity.value) * granularity.value)
        handle = ctypes.c_ulonglong(0)
        _checked(cuda.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop),
                                  ctypes.c_ulonglong(0)), "cuMemCreate")
        fd = ctypes.c_int(-1)
        _checked(cuda.cuMemExportToShareableHandle(ctypes.byref(fd), handle, ctypes.c_int(_POSIX_FD),
                                                   ctypes.c_ulonglong(0)),
                 "cuMemExportToShareableHandle")
        return cls(handle.value, size, device, exported=fd.value), fd.value

    @classmethod
    def take(cls, pid: int, fd: int, size: int) -> Shared:
        """Maps the allocation that descriptor `fd` of process `pid` exports."""
        torch.zeros(1, device="cuda")
        device = torch.cuda.current_device()
        ours = take_descriptor(pid, fd)
        try:
            handle = ctypes.c_ulonglong(0)
            _checked(_cuda().cuMemImportFromShareableHandle(
                ctypes.byref(handle), ctypes.c_void_p(ours), ctypes.c_int(_POSIX_FD)),
                "cuMemImportFromShareableHandle")
        finally:
            os.close(ours)
        return cls(handle.value, size, device)

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...] | list[int], offset: int = 0,
               strides: tuple[int, ...] | list[int] | None = None) -> torch.Tensor:
        """A tensor of its own (not a view) on this memory at byte `offset`."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if offset % itemsize:
            raise ValueError("a tensor's place must be a multiple of its element size")
        typed = self.bytes.view(dtype)
        tensor = torch.empty(0, dtype=dtype, device=self.bytes.device)
        size = list(shape)
        stride = list(strides) if strides is not None else list(torch.empty(size, device="meta").stride())
        tensor.set_(typed.untyped_storage(), offset // itemsize, size, stride)
        return tensor

    def close(self) -> None:
        """Unmaps and releases it, and closes the descriptor it was exported by: a staging
        buffer per timed slot whose descriptor stayed open kept 40 GiB of an H100 out of
        every process's count by the paged ops' sixth workload, until an allocation failed.
        (Whoever mapped it has its own copy of the descriptor by then.)"""
        cuda = _cuda()
        cuda.cuMemUnmap(self._address, ctypes.c_size_t(self.size))
        cuda.cuMemAddressFree(self._address, ctypes.c_size_t(self.size))
        cuda.cuMemRelease(self._handle)
        if self._exported is not None:
            os.close(self._exported)
            self._exported = None


def take_descriptor(pid: int, fd: int) -> int:
    """A duplicate, in this process, of another process's descriptor."""
    pidfd = os.pidfd_open(pid)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        ours = libc.syscall(ctypes.c_long(_NR_PIDFD_GETFD), ctypes.c_long(pidfd), ctypes.c_long(fd),
                            ctypes.c_long(0))
        if ours < 0:
            code = ctypes.get_errno()
            raise DeviceMemoryError(code, f"pidfd_getfd of descriptor {fd} of process {pid}: "
                                          f"{os.strerror(code)}")
        return int(ours)
    finally:
        os.close(pidfd)

