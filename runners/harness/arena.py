"""Where a call's inputs live: one shared-memory file the judge writes and every child maps.

The judge makes each call's inputs itself, at the call (never before: a child holds no
input of a call before that call starts), and writes them here while every child is
stopped. Each child maps the file copy-on-write: it reads the judge's latest bytes, and
a candidate that writes into its inputs writes a private copy of the page, which the
judge reads back from outside (`observe.Outside`) to see that it did, and which keeps
that candidate's later inputs stale.

The layout of one workload's inputs (which tensor at which offset, and the plain values
between them, in forward's order) crosses the wire as JSON; the bytes never do.
"""

from __future__ import annotations

import ctypes
import fcntl
import math
import mmap
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from runners.harness import wire

NAME = "kernel-lab-inputs"
_ALIGN = 4096


@dataclass(frozen=True)
class Entry:
    """One of forward's arguments: a tensor at `offset`, or a plain `value`."""

    name: str
    dtype: str | None = None
    shape: tuple[int, ...] = ()
    offset: int = 0
    value: Any = None

    @property
    def is_tensor(self) -> bool:
        return self.dtype is not None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * wire.DTYPES[self.dtype].itemsize if self.dtype else 0

    def to_dict(self) -> dict[str, Any]:
        if self.is_tensor:
            return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape),
                    "offset": self.offset}
        return {"name": self.name, "value": self.value}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Entry:
        if "dtype" in data:
            return cls(data["name"], data["dtype"], tuple(data["shape"]), int(data["offset"]))
        return cls(data["name"], value=data["value"])


def layout(inputs: Mapping[str, Any]) -> list[Entry]:
    """Where each tensor of one input set goes (page-aligned, in order) and the plain
    values, as forward receives them."""
    entries, offset = [], 0
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor):
            entry = Entry(name, wire.dtype_name(value.dtype), tuple(value.shape), offset)
            entries.append(entry)
            offset += -(-entry.nbytes // _ALIGN) * _ALIGN
        else:
            entries.append(Entry(name, value=value))
    return entries


def size(entries: list[Entry]) -> int:
    return max((entry.offset + entry.nbytes for entry in entries if entry.is_tensor), default=0)


def stride(entries: list[Entry]) -> int:
    """How far apart, page-aligned, input sets of this layout lie side by side."""
    return max(_ALIGN, -(-size(entries) // _ALIGN) * _ALIGN)


def shifted(entries: list[Entry], by: int) -> list[Entry]:
    """The same layout `by` bytes further on: the place of another input set."""
    return [Entry(entry.name, entry.dtype, entry.shape, entry.offset + by) if entry.is_tensor
            else entry for entry in entries]


# Linux 5.1's F_SEAL_FUTURE_WRITE (Python's fcntl does not name it): no write and no
# shared writable mapping from now on; mappings that exist keep working.
_F_SEAL_FUTURE_WRITE = 0x0010


class Arena:
    """The judge's side: the file, mapped shared, sized for the largest input set."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(_ALIGN, -(-capacity // _ALIGN) * _ALIGN)
        self.fd = os.memfd_create(NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, self.capacity)
        # Every child maps this one file, the baselines' inputs with the candidate's: a
        # candidate able to write it could slow the baselines (subnormal weights), punch
        # holes they fault on, or shrink it under the judge (SIGBUS). So its size is
        # sealed, only its owner may open it for writing, and the children get a
        # descriptor opened read-only (`child_fd`), which refuses write, fallocate and
        # ftruncate; a copy-on-write mapping needs no more.
        os.fchmod(self.fd, 0o600)
        self.child_fd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)
        self._map = mmap.mmap(self.fd, self.capacity, mmap.MAP_SHARED,
                              mmap.PROT_READ | mmap.PROT_WRITE)
        # Sealed once the judge's own writable mapping exists: from then on no one, the
        # file's owner included, writes it but through that mapping (a reopening by a
        # /proc descriptor link with O_RDWR still cannot write, whatever the path checks
        # and the children's user), and the children's copy-on-write mappings are theirs.
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
                    | _F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)

    def write(self, entries: list[Entry], inputs: Mapping[str, Any]) -> None:
        for entry in entries:
            if not entry.is_tensor:
                continue
            source = inputs[entry.name].detach().contiguous().reshape(-1).view(torch.uint8)
            if source.numel() != entry.nbytes or entry.offset + entry.nbytes > self.capacity:
                raise ValueError(f"input {entry.name} does not fit its place in the arena")
            target = torch.frombuffer(self._map, dtype=torch.uint8, count=entry.nbytes,
                                      offset=entry.offset)
            target.copy_(source.cpu())

    def close(self) -> None:
        self._map.close()
        os.close(self.child_fd)
        os.close(self.fd)


class Mapped:
    """A child's side: the same file mapped copy-on-write, and tensors on it."""

    def __init__(self, fd: int, capacity: int) -> None:
        self._map = mmap.mmap(fd, capacity, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
        # Where the mapping starts, told to the judge before any candidate code runs, so
        # it reads the inputs this process passes to forward.
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))

    def arguments(self, entries: list[Entry]) -> tuple[Any, ...]:
        found = []
        for entry in entries:
            if not entry.is_tensor:
                found.append(entry.value)
                continue
            flat = torch.frombuffer(self._map, dtype=wire.DTYPES[entry.dtype],
                                    count=math.prod(entry.shape), offset=entry.offset)
            # A tensor of its own on that memory, not a view: a harness input should
            # look like any caller's tensor.
            tensor = torch.empty(0, dtype=flat.dtype)
            tensor.set_(flat.untyped_storage(), flat.storage_offset(), entry.shape)
            found.append(tensor)
        return tuple(found)
