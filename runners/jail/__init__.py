"""The jail a child of the harness runs in: an operating-system boundary, not a Python one.

A candidate's process (and each baseline's, alike) runs in its own PID, mount, network,
IPC and UTS namespaces, as an unprivileged user with no capabilities and no way to gain
any, on a root file system of its own: the system, Python, torch and the project
read-only, the one scratch folder writable, a /proc that shows only its own processes.
A seccomp filter hands every call that could leave the jail, start a program or write a
file by name to a supervisor outside it, which refuses what the plan does not allow and
tells the judge. When its first process ends, the kernel ends everything it started.

- `plan`: what a child may see and do, decided by the judge;
- `enter`: the child's side, building the walls before the worker starts;
- `filter`: the system-call filter;
- `supervisor`: the child's parent, answering the filter and reporting to the judge.

Nothing here imports torch or the harness: the supervisor starts in milliseconds and
the child has nothing of the judge's in it.
"""
