"""Kernel DSLs (Triton, CuTe DSL): the child's environment, a static check, launch counts.

A thesis may require its kernels to be written in a DSL. Whether a candidate really is
gets judged twice: statically here (the file defines a DSL kernel that forward
launches), and at run time around each call, since a kernel that is defined and
launched on some branch may still never run, and one that runs may do a token part of
the work beside torch: the DSL's launches are counted, and the torch ops the call ran
outside them are recorded by name for `torch_compute` to sort.

Triton and CuTe DSL are imported only inside the functions that need them: a GPU host
may have one without the other, and the torch path needs neither.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.util
import sys
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Set
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from runners import python_source

DSLS = ("torch", "triton", "cute")

# Kernel files name their DSL: `rows_triton.py`, `rows_cute.py`; anything else is torch.
_SUFFIXES = {"_triton": "triton", "_cute": "cute"}


def kernel_dsl(path: Path) -> str:
    """The DSL a shipped kernel file claims by its name's suffix: a default for what to
    ask of a candidate, never evidence of what a kernel is (written_in reads that)."""
    for suffix, dsl in _SUFFIXES.items():
        if Path(path).stem.endswith(suffix):
            return dsl
    return "torch"


def _device_kind(device: str) -> str:
    return str(device).split(":", 1)[0]


def child_environment(dsl: str, device: str, scratch: Path) -> dict[str, str]:
    """Variables to add to a candidate child's environment.

    Every cache lives in the candidate's own scratch directory, whatever its DSL (a
    torch candidate may still compile through Triton or inductor): no candidate sees
    another's compiled artefacts, and none writes outside its sandbox.
    """
    _known(dsl)
    scratch = Path(scratch)
    folders = {
        "TRITON_CACHE_DIR": scratch / "triton-cache",
        "TORCH_EXTENSIONS_DIR": scratch / "torch-extensions",
        "TORCHINDUCTOR_CACHE_DIR": scratch / "inductor-cache",
        # CuTe DSL's compiled-module cache, and where it writes kept PTX/CUBIN
        # (CUTE_DSL_KEEP): by default the working directory, and only into a folder
        # that exists, hence created here.
        "CUTE_DSL_CACHE_DIR": scratch / "cute-dsl-cache",
        "CUTE_DSL_DUMP_DIR": scratch / "cute-dsl-dump",
    }
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=True)
    env = {name: str(folder) for name, folder in folders.items()}
    on_cpu = _device_kind(device) == "cpu"
    # Set both ways: an interpreter inherited from the parent's environment would make
    # CUDA timings meaningless. Triton reads it when a kernel is decorated, its own
    # library (tl.sum, ...) included, so it must be set before triton is imported.
    env["TRITON_INTERPRET"] = "1" if dsl == "triton" and on_cpu else "0"
    if dsl == "cute" and on_cpu:
        # With no GPU to detect, CuTe DSL silently targets sm_100a; the GPUs this
        # compile check stands for are Hopper.
        env["CUTE_DSL_ARCH"] = "sm_90a"
    return env


def timings_meaningful(dsl: str, device: str) -> bool:
    """False where a time says nothing about the GPU: Triton's CPU interpreter runs numpy."""
    _known(dsl)
    return not (dsl == "triton" and _device_kind(device) == "cpu")


def _known(dsl: str) -> None:
    if dsl not in DSLS:
        raise ValueError(f"unknown DSL {dsl!r} (known: {', '.join(DSLS)})")


# --- static check -------------------------------------------------------------------


def written_in(source: str) -> str:
    """The DSL a kernel's source really launches from forward, by the static check: the
    kept kernel is run in the environment and with the op counting of what it is, not of
    what its file or an imported results file calls it (a torch kernel named `_triton`
    would have its baseline runs slowed by the DSL's recording of torch ops)."""
    for dsl in ("cute", "triton"):
        if static_check(source, dsl)[0] == "pass":
            return dsl
    return "torch"



def static_check(source: str, dsl: str) -> tuple[str, str]:
    """("pass" | "fail", why): is there a `dsl` kernel that forward launches?

    Reads the source with `ast` only; the candidate is never run here. The call graph
    is followed through functions defined in the file, by name, so a launch in a
    helper that forward calls counts and a kernel that is only defined does not.
    """
    _known(dsl)
    if dsl == "torch":
        return "pass", "torch candidates need no DSL kernel"
    try:
        tree = python_source.parse(source)
    except SyntaxError as error:
        return "fail", f"not valid Python: {error.msg} (line {error.lineno})"
    return (_check_triton if dsl == "triton" else _check_cute)(_Source(tree))


class _Source:
    """A parsed candidate: its imports, its function definitions and its classes."""

    def __init__(self, tree: ast.Module) -> None:
        # Local name -> the dotted module path it stands for.
        self.imports: dict[str, str] = {}
        self.functions: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]] = {}
        self.classes: dict[str, ast.ClassDef] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        self.imports[alias.asname] = alias.name
                    else:
                        head = alias.name.split(".")[0]
                        self.imports[head] = head
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    self.imports[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions.setdefault(node.name, []).append(node)
            elif isinstance(node, ast.ClassDef):
                self.classes[node.name] = node

    def imports_module(self, module: str) -> bool:
        return any(
            path == module or path.startswith(module + ".") for path in self.imports.values()
        )

    def qualified(self, node: ast.expr) -> str | None:
        """`tl.dot` -> "triton.language.dot" when tl is triton.language; else None."""
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name) or node.id not in self.imports:
            return None
        return ".".join([self.imports[node.id], *reversed(parts)])

    def decorated(self, name: str) -> set[str]:
        """Names of the functions with a decorator that is (or calls) `name`."""
        found = set()
        for definitions in self.functions.values():
            for function in definitions:
                for decorator in function.decorator_list:
                    target = decorator.func if isinstance(decorator, ast.Call) else decorator
                    if self.qualified(target) == name:
                        found.add(function.name)
        return found

    def callees(self, function: ast.AST) -> Iterator[str]:
        """Functions of this file that `function` calls, hands to a compiler, or
        constructs (a class's __init__ and __call__)."""
        for node in ast.walk(function):
            if not isinstance(node, ast.Call):
                continue
            yield from self._names(node.func)
            # cute.compile(fn, ...) and cute.compile[options](fn, ...) reach fn.
            compiler = node.func.value if isinstance(node.func, ast.Subscript) else node.func
            if self.qualified(compiler) == "cutlass.cute.compile" and node.args:
                yield from self._names(node.args[0])

    def _names(self, node: ast.expr) -> Iterator[str]:
        if isinstance(node, ast.Call):
            node = node.func
        name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
        if name in self.functions:
            yield name
        if name in self.classes:
            for member in self.classes[name].body:
                if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                    member.name in ("__init__", "__call__")
                ):
                    yield member.name

    def reachable(self, starts: Set[str], stop: Set[str] = frozenset()) -> dict[str, list[str]]:
        """Functions reachable from `starts` through callees -> the call path to each.

        Functions in `stop` are reached but not entered (a Triton kernel's own calls
        are device code, not launches).
        """
        paths = {name: [name] for name in starts if name in self.functions}
        queue = deque(paths)
        while queue:
            name = queue.popleft()
            if name in stop:
                continue
            for function in self.functions[name]:
                for callee in self.callees(function):
                    if callee not in paths:
                        paths[callee] = [*paths[name], callee]
                        queue.append(callee)
        return paths

    def calls_in(self, name: str) -> Iterator[ast.Call]:
        for function in self.functions.get(name, []):
            for node in ast.walk(function):
                if isinstance(node, ast.Call):
                    yield node


def _callee_name(node: ast.expr) -> str | None:
    return node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)


def _path(path: list[str]) -> str:
    return " → ".join(path)


def _no_forward(source: _Source) -> tuple[str, str] | None:
    if "forward" not in source.functions:
        return "fail", "defines no `def forward(...)` whose calls the check could follow"
    return None


def _check_triton(source: _Source) -> tuple[str, str]:
    if not source.imports_module("triton"):
        return "fail", (
            "does not import triton: a Triton candidate must define its kernel in Triton"
        )
    kernels = source.decorated("triton.jit")
    if not kernels:
        return "fail", "imports triton but defines no @triton.jit kernel"
    missing = _no_forward(source)
    if missing:
        return missing
    paths = source.reachable({"forward"}, stop=kernels)
    for name, path in paths.items():
        if name in kernels:
            continue
        for call in source.calls_in(name):
            if isinstance(call.func, ast.Subscript) and _callee_name(call.func.value) in kernels:
                kernel = _callee_name(call.func.value)
                return "pass", f"forward launches @triton.jit kernel {kernel} ({_path(path)})"
    listed = ", ".join(sorted(kernels))
    return "fail", (
        f"defines @triton.jit kernel(s) {listed}, but neither forward nor any function it "
        "calls launches one as `kernel[grid](...)`"
    )


def _check_cute(source: _Source) -> tuple[str, str]:
    if not source.imports_module("cutlass.cute"):
        return "fail", (
            "does not import cutlass.cute: a CuTe candidate must define its kernel in CuTe DSL"
        )
    kernels = source.decorated("cutlass.cute.kernel")
    if not kernels:
        return "fail", "imports cutlass.cute but defines no @cute.kernel"
    host = source.decorated("cutlass.cute.jit")
    if not host:
        return "fail", "defines no @cute.jit function to launch its @cute.kernel from"
    missing = _no_forward(source)
    if missing:
        return missing
    from_forward = source.reachable({"forward"})
    reached_host = {name for name in from_forward if name in host}
    # A launch counts inside a @cute.jit function forward reaches, or in host code
    # that function calls: `kernel(...).launch(grid=..., block=...)`.
    for name, path in source.reachable(reached_host).items():
        for call in source.calls_in(name):
            func = call.func
            if (
                isinstance(func, ast.Attribute) and func.attr == "launch"
                and isinstance(func.value, ast.Call) and _callee_name(func.value.func) in kernels
            ):
                kernel = _callee_name(func.value.func)
                route = _path([*from_forward[path[0]], *path[1:]])
                return "pass", f"forward launches @cute.kernel {kernel} ({route})"
    listed = ", ".join(sorted(kernels))
    if not reached_host:
        return "fail", (
            f"defines @cute.kernel {listed}, but forward never calls or compiles "
            "(cute.compile) a @cute.jit function"
        )
    return "fail", (
        f"defines @cute.kernel {listed}, but no @cute.jit function that forward reaches "
        "launches it as `kernel(...).launch(...)`"
    )


# --- launch counting and torch ops ---------------------------------------------------


@dataclass
class LaunchCount:
    # DSL kernel launches (Triton) or compiled-function calls (CuTe) in the block.
    count: int = 0
    # Explicit cute.compile calls in the block (CuTe only).
    compiles: int = 0
    # The aten ops the candidate's own code ran in the block, by name ("aten.mm"):
    # allocation and views as well as compute; `torch_compute` tells them apart. Ops
    # the DSL runs itself while launching (the interpreter copying arguments) are not
    # the candidate's and are left out.
    torch_ops: Counter[str] = field(default_factory=Counter)


# The packages whose own code may run torch ops inside a launch without it counting
# against the candidate.
_DSL_PACKAGES = {"triton": "triton", "cute": "cutlass"}


@contextlib.contextmanager
def launch_counter(dsl: str) -> Iterator[LaunchCount]:
    """Count the DSL's launches inside the block, and record the torch ops run beside them,
    in the candidate's own process.

    Host-side launches are counted: a CUDA graph replay launches nothing from Python,
    so count around an eager call (or the capture), not a replay. Everything patched
    is restored on exit, also when the block raises. A torch candidate is left alone:
    all its work is torch's, so there is nothing to count or record.
    """
    _known(dsl)
    counter = LaunchCount()
    with contextlib.ExitStack() as restore:
        if dsl != "torch":
            # The first op under a dispatch mode imports torch._dynamo (a second on a
            # CPU): here, so that it is not charged to the first call's time.
            import torch._dynamo  # noqa: F401
            recorder = _TorchOps(counter.torch_ops, _DSL_PACKAGES[dsl])
            restore.enter_context(recorder)
            (_count_triton if dsl == "triton" else _count_cute)(counter, recorder, restore)
        yield counter


def _wrap(owner: type, name: str, restore: contextlib.ExitStack,
          wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = owner.__dict__[name]
    setattr(owner, name, wrapper(original))
    restore.callback(setattr, owner, name, original)


def _count_triton(counter: LaunchCount, recorder: _TorchOps,
                  restore: contextlib.ExitStack) -> None:
    try:
        import triton.runtime.interpreter as interpreter
        from triton import knobs
        from triton.runtime.autotuner import Autotuner
        from triton.runtime.jit import JITFunction
    except ImportError:
        return  # no Triton here, so no Triton kernel can launch

    def entered(*_: Any, **__: Any) -> None:
        counter.count += 1

    # Compiled kernels: the launcher itself calls the launch-enter hooks, a chain in
    # Triton 3.6 and 3.9 alike, so other hooks keep working beside this one.
    hooks = knobs.runtime.launch_enter_hook
    hooks.add(entered)
    restore.callback(hooks.remove, entered)

    # The CPU interpreter never calls those hooks: count its grid launches instead
    # (warm-up calls compile nothing and launch nothing there).
    def counting(run: Callable[..., Any]) -> Callable[..., Any]:
        def run_counted(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not kwargs.get("warmup"):
                counter.count += 1
            return run(self, *args, **kwargs)

        return run_counted

    _wrap(interpreter.InterpretedFunction, "run", restore, counting)
    # Where Triton runs torch ops of its own: the interpreter copies every argument to
    # the host and back around a grid; the autotuner allocates and clears its
    # benchmarking buffers and saves and restores `restore_value` arguments.
    for owner in (interpreter.InterpretedFunction, JITFunction, Autotuner):
        _wrap(owner, "run", restore, recorder.inside_dsl)


def _count_cute(counter: LaunchCount, recorder: _TorchOps,
                restore: contextlib.ExitStack) -> None:
    try:
        import cutlass.base_dsl.jit_executor as jit_executor
        from cutlass.base_dsl.compiler import CompileCallable
        from cutlass.base_dsl.jit_executor import JitExecutor
    except ImportError:
        return  # no CuTe DSL here, so no CuTe kernel can launch

    # Every way of running compiled CuTe code (calling what cute.compile returned, or a
    # @cute.jit function directly) ends in JitExecutor.run_compiled_program. Counted
    # once it returns: a call that failed launched nothing.
    def counting_launches(run: Callable[..., Any]) -> Callable[..., Any]:
        def run_counted(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = run(self, *args, **kwargs)
            counter.count += 1
            return result

        return run_counted

    def counting_compiles(compile_: Callable[..., Any]) -> Callable[..., Any]:
        def compile_counted(self: Any, *args: Any, **kwargs: Any) -> Any:
            counter.compiles += 1
            return compile_(self, *args, **kwargs)

        return compile_counted

    _wrap(JitExecutor, "run_compiled_program", restore, counting_launches)
    _wrap(CompileCallable, "_compile", restore, counting_compiles)
    # Where CuTe DSL may touch torch tensors itself: compiling, turning the arguments of
    # a launch (torch tensors through DLPack) into the compiled program's, and running it.
    # ExecutionArgs is CuTe DSL 4.8's; where a release lacks it, whatever torch ops its
    # argument conversion runs are charged to the candidate, by name, for a reviewer.
    entries = ((CompileCallable, "_compile"), (JitExecutor, "run_compiled_program"),
               (getattr(jit_executor, "ExecutionArgs", None), "generate_execution_args"))
    for owner, name in entries:
        if owner is not None and name in vars(owner):
            _wrap(owner, name, restore, recorder.inside_dsl)


class _TorchOps(TorchDispatchMode):
    """Records, by name, every aten op dispatched while it is active, except the DSL's own.

    An op is the DSL's own only when both hold: a DSL entry point is running (a launch,
    a compile; marked by `inside_dsl`), and the code that asked for the op is the DSL
    package's. The first condition alone would let candidate code that Triton calls
    during a launch (a pre-run hook, a grid function, an autotuner pre_hook) compute in
    torch unseen; the second alone would let a candidate call a DSL helper that computes
    in torch.
    """

    def __init__(self, ops: Counter[str], package: str) -> None:
        super().__init__()
        self.ops = ops
        self.package = package
        self.depth = 0

    def inside_dsl(self, entry: Callable[..., Any]) -> Callable[..., Any]:
        """`entry` marked as a DSL entry point for as long as it runs (a `_wrap` wrapper)."""
        def marked(owner: Any, *args: Any, **kwargs: Any) -> Any:
            self.depth += 1
            try:
                return entry(owner, *args, **kwargs)
            finally:
                self.depth -= 1

        return marked

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if not (self.depth and _within(_requester(sys._getframe(1)), self.package)):
            self.ops[_op_name(func)] += 1
        return func(*args, **(kwargs or {}))


def _op_name(func: Any) -> str:
    """"aten.mm" for aten.mm.default: the overload says nothing a reviewer needs."""
    return str(func.overloadpacket)


def _requester(frame: FrameType | None) -> str | None:
    """The module whose code asked for an op: the first frame outside torch's own modules
    (torch.nn.functional and Tensor methods run on behalf of whoever called them).

    A frame belongs to a module only if it runs in that module's namespace: code exec'd
    under a borrowed `__name__` belongs to nobody, so it can pass for neither torch nor
    the DSL. And a frame passes for torch's or a DSL's only if its code is that package's
    own, compiled from the module's file where the package is installed: a candidate's
    function rebuilt around a torch or Triton module's globals
    (`types.FunctionType(code, vars(triton.language))`), a hook say, is in the right
    namespace but runs code no such file holds, so it too belongs to nobody.
    """
    while frame is not None:
        name = frame.f_globals.get("__name__")
        module = sys.modules.get(name) if isinstance(name, str) else None
        if module is None or vars(module) is not frame.f_globals:
            return None
        trusted = _within(name, "torch") or any(_within(name, package) for package in _DSL_PACKAGES.values())
        if trusted and not _genuine(frame.f_code, name):
            return None
        if not _within(name, "torch"):
            return name
        frame = frame.f_back
    return None


def _package_roots(package: str) -> tuple[Path, ...]:
    spec = importlib.util.find_spec(package)
    return tuple(Path(location) for location in (spec.submodule_search_locations or ())) if spec else ()


# Where torch and the DSLs are installed, read when the harness is imported: before any
# candidate runs, so no candidate can point these elsewhere.
_PACKAGE_ROOTS = {package: _package_roots(package) for package in ("torch", *_DSL_PACKAGES.values())}
_GENUINE: dict[int, tuple[CodeType, bool]] = {}


def _genuine(code: CodeType, module: str) -> bool:
    """Whether `code` is code of the installed file of `module` (a torch or DSL module):
    equal to a code object compiled from that file. Equal code objects have the same
    instructions, constants and names, so one that is equal does what the file does."""
    known = _GENUINE.get(id(code))
    if known is None or known[0] is not code:
        known = _GENUINE[id(code)] = (code, code in _codes_of(module))
    return known[1]


@functools.lru_cache(maxsize=None)
def _codes_of(module: str) -> frozenset[CodeType]:
    package, *parts = module.split(".")
    files = [candidate for root in _PACKAGE_ROOTS.get(package, ())
             for candidate in (root.joinpath(*parts).with_suffix(".py"), root.joinpath(*parts, "__init__.py"))
             if candidate.is_file()]
    if not files:
        return frozenset()
    try:
        pending = [compile(files[0].read_bytes(), str(files[0]), "exec", dont_inherit=True)]
    except (SyntaxError, ValueError):
        return frozenset()
    codes = set()
    while pending:
        code = pending.pop()
        codes.add(code)
        pending.extend(constant for constant in code.co_consts if isinstance(constant, CodeType))
    return frozenset(codes)


def _within(module: str | None, package: str) -> bool:
    return module is not None and (module == package or module.startswith(package + "."))


# --- which torch ops compute ---------------------------------------------------------

# The aten ops a DSL candidate may run in torch beside its kernels: none reads the value
# of any tensor element, so none can compute any part of the answer.
# - Allocation hands out memory, uninitialised or holding one constant; an output must
#   come from somewhere, and the `_like`/`new_` forms read only their model's metadata.
# - Fills write one constant: a kernel that adds into its output atomically, or
#   accumulates across launches, needs it zeroed first.
# - Views re-describe memory that exists (shape, strides, offset, storage) and move no
#   data. `.contiguous()` and `.reshape()` never show up themselves: on a tensor that
#   needs no copy they dispatch nothing or a view, and where they must copy, the copy
#   shows up (aten.clone) and counts.
# Everything else reads tensor values and is torch compute: arithmetic, reductions,
# matmuls, sorting, and copies too. A copy (clone, copy_, _to_copy, with a dtype change
# or not) is a torch kernel moving the op's data, which for a layout change or a gather
# is the op's work itself. Ops outside the aten namespace are compute as well: a custom
# op hides whatever torch code it runs behind one name.
_ALLOCATION = frozenset({
    "empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided",
    "zeros", "zeros_like", "new_zeros", "ones", "ones_like", "new_ones",
    "full", "full_like", "new_full", "scalar_tensor", "resize_",
})
_FILLS = frozenset({"zero_", "fill_", "zero", "fill"})
_VIEWS = frozenset({
    "view", "_unsafe_view", "_reshape_alias", "reshape", "view_as", "as_strided",
    "expand", "expand_as", "permute", "movedim", "transpose", "t", "unsqueeze", "squeeze",
    "flatten", "unflatten", "select", "slice", "narrow", "split", "split_with_sizes",
    "chunk", "unbind", "diagonal", "unfold", "detach", "alias", "lift_fresh", "set_",
    "view_as_real", "view_as_complex",
})
_NOT_COMPUTE = frozenset(f"aten.{name}" for name in _ALLOCATION | _FILLS | _VIEWS)


def torch_compute(ops: Mapping[str, int]) -> Counter[str]:
    """The ops among `ops` (name -> times run) that are torch compute, with their counts."""
    return Counter({name: count for name, count in ops.items()
                    if name not in _NOT_COMPUTE and count > 0})


def describe_ops(ops: Mapping[str, int], most: int = 6) -> str:
    """"aten.mm ×2, aten.topk ×1": the most run first, for a reviewer to read."""
    ranked = sorted(ops.items(), key=lambda item: (-item[1], item[0]))
    shown = ", ".join(f"{name} ×{count}" for name, count in ranked[:most])
    return shown + (f" and {len(ranked) - most} more" if len(ranked) > most else "")
