"""A broken end-to-end program: it fails before printing any metric."""

import sys

print("loading the model...", file=sys.stderr)
sys.exit("RuntimeError: checkpoint not found: /models/llama.safetensors")
