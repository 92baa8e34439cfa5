"""Code that kernels share: `from runners.kernel_lib.<module> import …`.

A kernel imports these modules like any other, and the harness evaluates it with exactly
the files it imports, read once, checked and hashed (runners/harness/imports.py). The
kernel workspace mirrors this folder as `kernels/lib/`. Nothing here may import the
harness or change what it holds fixed.
"""
