"""A slow all-reduce (the library's on a group of its own, plus 20 ms) that remembers what it
returned: a call on a tensor it has summed before returns that sum again at once,
whatever the peers' shares are now; and once it has summed a shape and dtype as many
times as a judge's checks of one workload call it (one per input distribution), every
later call of that shape returns the last sum at once. Against a judge that times one
prepared tensor per workload and never reads a timed output, it "wins" by 2.5-9x."""
import time
import weakref

from torch.distributed import distributed_c10d as c10d

CHECKS_PER_SHAPE = 2  # runners.ops.DISTRIBUTIONS: the calls a judge checks per workload
_group = None
_by_tensor = {}
_by_shape = {}


def setup(comm):
    global _group
    _group = c10d.new_group(backend="gloo")


def forward(x, comm):
    hit = _by_tensor.get(id(x))
    if hit is not None and hit[0]() is x:
        return hit[1]
    key = (tuple(x.shape), x.dtype)
    calls, last = _by_shape.get(key, (0, None))
    if calls >= CHECKS_PER_SHAPE:
        return last
    out = x.clone()
    c10d.all_reduce(out, group=_group)
    time.sleep(0.02)
    _by_tensor[id(x)] = (weakref.ref(x), out)
    _by_shape[key] = (calls + 1, out)
    return out
