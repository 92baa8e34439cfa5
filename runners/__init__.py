"""Code that runs on the GPU host: ops, the harness, parameter spaces.

Pure Python on top of torch, numpy and scipy: nothing here may import Django,
because the GPU host has only python3 and those libraries.
"""

from __future__ import annotations
