"""Falls back to the collective library through the process group object itself, past
torch.distributed's functions (which a wrapper could count): only the group's own count
of its collectives sees it."""


def forward(x, comm):
    out = x.clone()
    comm.group.allreduce([out]).wait()
    return out
