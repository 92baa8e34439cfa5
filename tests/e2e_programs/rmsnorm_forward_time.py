"""An end-to-end program for rmsnorm: loads the kernel KERNEL_FILE names, times a few
calls of its forward on a small input, and prints the time as its metric."""

import importlib.util
import json
import os
import time

import torch

CALLS = 20


def load_kernel(path: str):
    spec = importlib.util.spec_from_file_location("kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    torch.set_num_threads(1)
    kernel = load_kernel(os.environ["KERNEL_FILE"])
    x, weight = torch.randn(64, 256), torch.randn(256)
    kernel.forward(x, weight, 1e-6)  # warm-up, off the clock
    started = time.perf_counter()
    for _ in range(CALLS):
        kernel.forward(x, weight, 1e-6)
    elapsed_ms = 1e3 * (time.perf_counter() - started)
    # Lines before the last are the program's own: only the last one is read.
    print(f"{os.environ['KERNEL_OP']} {os.environ['KERNEL_ROLE']}: {CALLS} calls")
    print(json.dumps({"metric": "forward_ms", "value": elapsed_ms}))


if __name__ == "__main__":
    main()
