"""The private channel between the judge and a child: framed JSON and raw bytes, never pickles.

A frame is an 8-byte big-endian length, a JSON header of that length, then the raw bytes
of each tensor the header lists (name, dtype, shape). Reading JSON and raw bytes cannot
run code, unlike unpickling, so a hostile child can at worst send garbage, which the
reader rejects. Every length is checked against a bound before anything is read.
"""

from __future__ import annotations

import json
import math
import os
import select
import struct
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

_PREFIX = struct.Struct(">Q")
# How often the reader's `waiting` callback runs while nothing has arrived (the judge
# reads a child's threads from outside while it works).
WAITING_EVERY_MS = 1
MAX_HEADER_BYTES = 1 << 20
MAX_DIMENSIONS = 8

# The dtypes a tensor may cross the channel in; anything else is refused by name.
DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
                  torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
                  torch.float8_e4m3fn, torch.float8_e5m2)
}


class ProtocolError(Exception):
    """A frame that is malformed, too large, or not the answer that was asked for."""


class ChannelClosed(Exception):
    """The other end closed its side: for a child, it exited or was killed."""


class ChannelTimeout(Exception):
    """No complete frame arrived before the deadline."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def write_message(fd: int, header: Mapping[str, Any],
                  tensors: Mapping[str, torch.Tensor] | None = None) -> None:
    """Send one frame; blocks until the reader has taken it all."""
    listed, payloads = [], []
    for name, tensor in (tensors or {}).items():
        listed.append({"name": name, "dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape)})
        payloads.append(_raw_bytes(tensor))
    encoded = json.dumps({**header, "tensors": listed}, allow_nan=False).encode()
    _write_all(fd, _PREFIX.pack(len(encoded)) + encoded)
    for payload in payloads:
        _write_all(fd, payload)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def read_message(fd: int, *, deadline: float | None = None, max_bytes: int = MAX_HEADER_BYTES,
                 waiting: Callable[[], None] | None = None,
                 ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Receive one frame: its header and its tensors, rebuilt from raw bytes.

    `deadline` is a time.monotonic() value (None waits for ever); `max_bytes` bounds the
    tensor payload, which is refused from its declared size before any of it is read;
    `waiting` is called about every WAITING_EVERY_S while no byte has come yet.
    """
    (length,) = _PREFIX.unpack(_read_exactly(fd, _PREFIX.size, deadline, waiting))
    if length > MAX_HEADER_BYTES:
        raise ProtocolError(f"a header of {length:,} bytes (at most {MAX_HEADER_BYTES:,})")
    try:
        header = json.loads(_read_exactly(fd, length, deadline))
    except (ValueError, RecursionError) as error:
        raise ProtocolError(f"a header that is not JSON ({type(error).__name__})") from None
    if not isinstance(header, dict):
        raise ProtocolError("a header that is not a JSON object")
    specs = [_checked_spec(spec) for spec in _listed(header.pop("tensors", []))]
    total = sum(nbytes for _, _, _, nbytes in specs)
    if total > max_bytes:
        raise ProtocolError(f"{total:,} bytes of tensors where at most {max_bytes:,} were expected")
    tensors = {}
    for name, dtype, shape, nbytes in specs:
        raw = _read_exactly(fd, nbytes, deadline)
        tensors[name] = (torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)
                         if nbytes else torch.empty(shape, dtype=dtype))
    return header, tensors


def _listed(value: object) -> list[Any]:
    if not isinstance(value, list) or len(value) > 16:
        raise ProtocolError("a tensor list that is not a short JSON array")
    return value


def _checked_spec(spec: object) -> tuple[str, torch.dtype, list[int], int]:
    if not isinstance(spec, dict):
        raise ProtocolError("a tensor description that is not a JSON object")
    name, dtype, shape = spec.get("name"), spec.get("dtype"), spec.get("shape")
    if not isinstance(name, str) or dtype not in DTYPES:
        raise ProtocolError(f"a tensor of unknown dtype {str(dtype)[:40]!r}")
    if (not isinstance(shape, list) or len(shape) > MAX_DIMENSIONS
            or not all(isinstance(size, int) and not isinstance(size, bool) and 0 <= size < 2**40
                       for size in shape)):
        raise ProtocolError(f"tensor {name[:40]!r} has an invalid shape")
    nbytes = math.prod(shape) * DTYPES[dtype].itemsize
    return name, DTYPES[dtype], shape, nbytes


def _read_exactly(fd: int, size: int, deadline: float | None,
                  waiting: Callable[[], None] | None = None) -> bytearray:
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    while got < size:
        if waiting is not None and got == 0:
            while not poller.poll(WAITING_EVERY_MS):
                waiting()
                if deadline is not None and time.monotonic() >= deadline:
                    raise ChannelTimeout(f"waited past the deadline with none of {size:,} bytes")
        if deadline is not None:
            left_ms = (deadline - time.monotonic()) * 1000
            if left_ms <= 0 or not poller.poll(max(1, math.ceil(left_ms))):
                raise ChannelTimeout(f"waited past the deadline with {got:,} of {size:,} bytes")
        count = os.readv(fd, [view[got:]])
        if count == 0:
            raise ChannelClosed("the other end closed the channel")
        got += count
    return buffer
