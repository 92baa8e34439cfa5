"""What the judge says when a process runs out of device memory, and that memory shared
between processes goes back to the device once closed (runners.harness.device_memory)."""

from __future__ import annotations

import os

import pytest
import torch

from runners.harness.device_memory import DeviceMemoryError, DeviceOutOfMemory, Shared, holders


def test_the_driver_out_of_memory_is_a_memory_error_and_a_device_memory_error():
    # A child's failure is read as running out of memory (the resources guard, or the
    # judge's account of who held it) only if it is a MemoryError; the judge's own
    # handlers of a refused share still catch it.
    error = DeviceOutOfMemory("cuMemCreate returned CUDA error 2: out of memory")
    assert isinstance(error, MemoryError) and isinstance(error, DeviceMemoryError)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU to read its memory")
def test_who_holds_the_device_memory_names_this_process_and_what_is_free():
    held = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    said = holders({os.getpid(): "the judge"})
    assert said.startswith("device memory then: ") and "GiB free of" in said
    assert "the judge's allocator" in said
    del held


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU to read its memory")
def test_shared_memory_goes_back_to_the_device_once_both_ends_close_it():
    # As a child's staging buffer: made and exported by the child, mapped by the judge,
    # closed by both when the slot is dropped. Its exported descriptor left open would
    # keep it (a gibibyte a slot, counted in no process's memory).
    torch.cuda.synchronize()
    before = torch.cuda.mem_get_info()[0]
    for _ in range(4):
        made, fd = Shared.create(2**30)
        taken = Shared.take(os.getpid(), fd, made.size)
        made.bytes.fill_(7)
        assert int(taken.bytes[-1]) == 7
        assert torch.cuda.mem_get_info()[0] <= before - 2**30
        taken.close()
        made.close()
    torch.cuda.synchronize()
    assert torch.cuda.mem_get_info()[0] >= before - 256 * 2**20
