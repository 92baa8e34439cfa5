"""A kernel's imports of shared kernel code: found by reading, checked, hashed and served.

Kernels share code through one package, `runners.kernel_lib` (`from
runners.kernel_lib.indexer_select import …`). Its modules live in a *lib folder*: the
shipped one is `runners/kernel_lib/`, the kernel workspace's is `kernels/lib/`. The
import reads the same wherever the kernel lies, so a shipped kernel copied into the
workspace runs unchanged, and outside the harness (tests, bench scripts, a GPU host)
it is an ordinary import of the project's own package.

The harness never lets a candidate's process import the package from wherever it finds
it. The judge:

1. reads the candidate's imports of the package with `ast` (`resolve`), following the
   imported modules' own imports, and refuses what it cannot follow: a module that is
   not a file of the lib folder, a file that leaves it (a link), and an import built at
   run time (`importlib.import_module(name)`, `__import__`);
2. checks every imported file as it checks the candidate (`check`): it must be Python,
   use no DSL but the candidate's, and change nothing the harness holds fixed;
3. reads each file once, hashes those bytes and writes them into a folder of the
   judge's (`serve`), which the child sees read-only; the project's own
   `runners/kernel_lib/` is hidden in the jail. In the child `install` makes the package
   that folder, so what runs is exactly what was hashed and checked, byte for byte,
   whatever happens to the lib folder after the judge read it.

Every imported file's path and sha256 goes into the result (`lib_files`), for the
review page and the results file.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from runners import python_source
from runners.harness import protected

PACKAGE = "runners.kernel_lib"
SHIPPED_LIB = Path(__file__).resolve().parents[1] / "kernel_lib"
# Calls that import a module named by their first argument: a name computed at run time
# could be any module of the package, which the judge could not read beforehand.
_DYNAMIC_IMPORTS = frozenset({
    "importlib.import_module", "importlib.__import__", "__import__", "builtins.__import__",
    "importlib.util.find_spec", "importlib.util.spec_from_file_location",
    "importlib.machinery.SourceFileLoader", "runpy.run_module", "runpy.run_path",
})
_DSL_PACKAGES = {"triton": "triton", "cute": "cutlass"}


class ImportRefused(Exception):
    """The kernel imports shared code in a way the harness cannot vouch for; the message
    names the file and the line. It rejects the candidate (the `imports` guard)."""


@dataclass(frozen=True)
class LibFile:
    path: str  # relative to the lib folder, with "/": "indexer_select.py"
    data: bytes  # the bytes read once, the very ones checked, hashed and served

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")

    def provenance(self) -> dict[str, str]:
        return {"path": self.path, "sha256": self.sha256}


def resolve(source: str, name: str, lib: Path = SHIPPED_LIB) -> list[LibFile]:
    """The files of the lib folder `lib` that `source` (the file `name`) imports, and
    those they import in turn, in the order first reached. A source that is not Python
    imports nothing here: the `loads` guard reports it. Raises ImportRefused."""
    try:
        tree = python_source.parse(source)
    except SyntaxError:
        return []
    folder = lib.resolve()
    found: dict[str, LibFile] = {}
    pending = [(name, tree, None)]
    while pending:
        where, tree, package = pending.pop(0)
        for parts in _imported_modules(tree, where, package, folder):
            for relative in _files_of(parts, folder, where):
                if relative in found:
                    continue
                data = (folder / relative).read_bytes()
                found[relative] = LibFile(relative, data)
                try:
                    parsed = python_source.parse(data.decode("utf-8"))
                except (SyntaxError, UnicodeDecodeError) as error:
                    raise ImportRefused(f"{_shown(relative)} is not valid Python: {error}") from None
                # A module's relative imports start from its package (a package's own
                # __init__.py's too): the folder it lies in.
                pending.append((_shown(relative), parsed, list(Path(relative).parent.parts)))
    return list(found.values())


def _shown(relative: str) -> str:
    return f"{PACKAGE.replace('.', '/')}/{relative}"


def _imported_modules(tree: ast.Module, where: str, package: list[str] | None,
                      folder: Path) -> Iterator[list[str]]:
    """Module paths inside the package (its parts below it; [] is the package itself)
    that `tree` imports. `package`: the parts of the lib module's own package, for its
    relative imports; None for the kernel file, which has none."""
    aliases = _import_aliases(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = _inside(alias.name)
                if parts is not None:
                    yield from _with_parents(parts)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if package is None:
                    continue  # the kernel is loaded as a top-level module: it fails to load
                if node.level - 1 > len(package):
                    raise ImportRefused(f"{where} line {node.lineno}: a relative import "
                                        "leaves the package")
                base = package[: len(package) - (node.level - 1)]
                parts = [*base, *(node.module.split(".") if node.module else [])]
            elif node.module == "runners" and any(a.name == "kernel_lib" for a in node.names):
                parts = []
            else:
                parts = _inside(node.module or "")
                if parts is None:
                    continue
            yield from _with_parents(parts)
            for alias in node.names:
                # `from runners.kernel_lib import select`: a module when there is one.
                if alias.name != "*" and _module_file(folder, [*parts, alias.name]) is not None:
                    yield [*parts, alias.name]
        elif isinstance(node, ast.Call):
            called = _dotted(node.func, aliases)
            if called in _DYNAMIC_IMPORTS:
                named = node.args[0] if node.args else None
                if not (isinstance(named, ast.Constant) and isinstance(named.value, str)):
                    raise ImportRefused(
                        f"{where} line {node.lineno}: {called}() with a name computed at run "
                        "time: the harness cannot see which module it imports. Import shared "
                        f"code with an import statement (from {PACKAGE}.<module> import …)")
                if "kernel_lib" in named.value:
                    raise ImportRefused(
                        f"{where} line {node.lineno}: imports {named.value!r} through {called}(): "
                        f"import shared code with an import statement (from {PACKAGE}.<module> "
                        "import …), which the harness reads")


def _inside(module: str) -> list[str] | None:
    if module == PACKAGE:
        return []
    if module.startswith(PACKAGE + "."):
        return module[len(PACKAGE) + 1:].split(".")
    return None


def _with_parents(parts: list[str]) -> Iterator[list[str]]:
    """Importing a.b.c runs the packages a and a.b first."""
    for end in range(len(parts) + 1):
        yield parts[:end]


def _module_file(folder: Path, parts: list[str]) -> Path | None:
    base = folder.joinpath(*parts) if parts else folder
    for candidate in (base / "__init__.py", base.with_suffix(".py") if parts else None):
        if candidate is not None and candidate.is_file():
            return candidate
    return None


def _files_of(parts: list[str], folder: Path, where: str) -> list[str]:
    """The file that module `parts` is (none for a package without __init__.py)."""
    shown = ".".join([PACKAGE, *parts])
    file = _module_file(folder, parts)
    if file is None:
        if parts and folder.joinpath(*parts).is_dir():
            return []  # a package without __init__.py: nothing of it runs
        if not parts:
            return []
        raise ImportRefused(f"{where} imports {shown}, which is not a module of the shared "
                            f"code (no {'/'.join(parts)}.py in its lib folder)")
    real = file.resolve()
    if not real.is_relative_to(folder):
        raise ImportRefused(f"{where} imports {shown}, whose file leads out of the lib folder "
                            f"(to {real})")
    return [real.relative_to(folder).as_posix()]


def _import_aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> the dotted path it stands for (`im` -> importlib.import_module)."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return aliases


def _dotted(node: ast.expr, aliases: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([aliases.get(node.id, node.id), *reversed(parts)])


# -- the checks a candidate gets, on every imported file --------------------------------

def check(files: list[LibFile], dsl: str,
          kept: list[LibFile] | None = None) -> tuple[tuple[str, str] | None, tuple[str, str] | None]:
    """(the DSL check's failure, the protected-settings check's failure) of the first
    imported file that fails each, naming it; None where every file passes. `kept`: the
    kept kernel's lib files, whose findings (accepted by a reviewer) are not held
    against the same file."""
    kept_text = {file.path: file.text for file in kept or []}
    wrong_dsl = settings = None
    for file in files:
        if wrong_dsl is None:
            other = _other_dsl(file.text, dsl)
            if other:
                wrong_dsl = ("fail", f"{_shown(file.path)} imports {other}: a {dsl} candidate's "
                                     f"shared code must be written in {dsl} or plain Python")
        if settings is None:
            found = protected.check(file.text, kept_text.get(file.path))
            if found is not None and found[0] == "fail":
                settings = ("fail", f"{_shown(file.path)}: {found[1]}")
    return wrong_dsl, settings


def _other_dsl(source: str, dsl: str) -> str | None:
    """The first DSL package other than `dsl`'s that `source` imports (a torch candidate
    may use any)."""
    if dsl not in _DSL_PACKAGES:
        return None
    others = {package for name, package in _DSL_PACKAGES.items() if name != dsl}
    tree = python_source.parse(source)
    for node in ast.walk(tree):
        names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                 else [])
        for name in names:
            if name.split(".")[0] in others:
                return name
    return None


def summary(files: list[LibFile]) -> str:
    """The `imports` guard's detail: what the candidate runs beside its own file."""
    if not files:
        return f"imports no shared code ({PACKAGE})"
    listed = ", ".join(f"{_shown(file.path)} (sha256 {file.sha256[:12]})" for file in files)
    return f"runs with exactly these shared files, read once and checked: {listed}"


# -- serving the hashed bytes to the child ---------------------------------------------

def serve(files: list[LibFile], folder: Path) -> Path:
    """Writes `files` (their bytes as read, never the lib folder's current ones) into the
    empty `folder`, readable by the child's unprivileged user and by nothing writable of
    its own. Returns the folder."""
    folder.mkdir(mode=0o755, parents=True, exist_ok=True)
    folder.chmod(0o755)
    for file in files:
        target = folder / file.path
        for parent in reversed(target.relative_to(folder).parents[:-1]):
            (folder / parent).mkdir(mode=0o755, exist_ok=True)
        target.write_bytes(file.data)
        target.chmod(0o444)
    return folder


class _ServedPackage(importlib.abc.MetaPathFinder):
    """Finds `runners.kernel_lib` in the served folder; its modules are then found
    through the package's __path__, which is that folder alone."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def find_spec(self, fullname: str, path: object = None, target: object = None):
        if fullname != PACKAGE:
            return None
        init = self.folder / "__init__.py"
        if init.is_file():
            return importlib.util.spec_from_file_location(
                PACKAGE, init, submodule_search_locations=[str(self.folder)])
        spec = importlib.machinery.ModuleSpec(PACKAGE, None, is_package=True)
        spec.submodule_search_locations = [str(self.folder)]
        return spec


def install(folder: Path) -> None:
    """In the child, before the kernel is imported: `runners.kernel_lib` is `folder`."""
    for name in [name for name in sys.modules if name == PACKAGE or name.startswith(PACKAGE + ".")]:
        del sys.modules[name]
    sys.meta_path.insert(0, _ServedPackage(Path(folder)))



def resolve_files(paths: list[Path], lib: Path = SHIPPED_LIB) -> list[LibFile]:
    """The lib files any of these kernel files imports, each once (a compound stage's
    kernels run in one process). Raises ImportRefused."""
    found: dict[str, LibFile] = {}
    for path in paths:
        for file in resolve(Path(path).read_text(encoding="utf-8", errors="replace"), Path(path).name, lib):
            found.setdefault(file.path, file)
    return list(found.values())


class Served:
    """One evaluation's shared files, the candidate's and the kept kernel's (which may
    differ: a candidate may change a shared module), each served in a folder of its own
    for as long as the evaluation runs."""

    def __init__(self, candidate: list[LibFile], kept: list[LibFile]) -> None:
        self.candidate = candidate
        self.kept = kept
        self._root = Path(tempfile.mkdtemp(prefix="kernel-lab-lib-"))
        self._root.chmod(0o755)  # the jailed child runs as another user
        self.candidate_folder = serve(candidate, self._root / "candidate")
        self.kept_folder = serve(kept, self._root / "kept")

    def close(self) -> None:
        shutil.rmtree(self._root, ignore_errors=True)
