"""The reward-hack catalogue as data: each known hack, the guards that reject it, and the
red-team candidates that play it, read from the table in skills/reward-hacks.md.

One table serves the agents and reviewers who read it and the tests and the red-team
script that check it, so the catalogue cannot drift from what is tested.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

CATALOG_PATH = Path(__file__).resolve().parents[2] / "skills" / "reward-hacks.md"

_CUDA_MARK = "(cuda)"
_CPU_MARK = "(cpu)"


class CatalogError(ValueError):
    """The catalogue's table is malformed."""


@dataclass(frozen=True)
class RedTeamCandidate:
    file: str
    cuda_only: bool
    # Plays its hack on a CPU only: on CUDA the call it attacks is a graph replay, which
    # runs none of its Python (a cache lookup, a patched eager runner, an aliased buffer
    # the graph writes by design).
    cpu_only: bool = False

    @property
    def op(self) -> str:
        return op_of(self.file)

    def plays_on(self, device: str) -> bool:
        """Whether the candidate plays its hack on `device` ("cpu" or "cuda")."""
        return not self.cpu_only if device == "cuda" else not self.cuda_only


def op_of(candidate_file: str) -> str:
    """The op a corpus candidate is written for, by the prefix of its file name."""
    # Before the bf16 paged prefix, which it begins with.
    if candidate_file.startswith("dsa_paged_fp8"):
        return "dsa_indexer_topk_paged_fp8"
    if candidate_file.startswith("dsa_paged"):
        return "dsa_indexer_topk_paged"
    if candidate_file.startswith("allreduce"):
        return "allreduce_sum"
    return "rmsnorm" if candidate_file.startswith("rmsnorm") else "dsa_indexer_topk"


@dataclass(frozen=True)
class Hack:
    title: str
    # What it looks like, or where it was seen: what an agent is told to avoid.
    description: str
    guards: tuple[str, ...]
    candidates: tuple[RedTeamCandidate, ...]


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _candidates(cell: str, where: str) -> tuple[RedTeamCandidate, ...]:
    found = []
    for item in filter(None, (part.strip() for part in cell.split(","))):
        name = item.removesuffix(_CUDA_MARK).removesuffix(_CPU_MARK).strip()
        if not re.fullmatch(r"[a-z0-9_]+\.py", name):
            raise CatalogError(f"{where}: {item!r} is not a candidate file name")
        found.append(RedTeamCandidate(name, item.endswith(_CUDA_MARK), item.endswith(_CPU_MARK)))
    return tuple(found)


def catalog(path: Path = CATALOG_PATH) -> list[Hack]:
    """Every row of every table whose header has `hack`, `guard` and `candidates`."""
    hacks: list[Hack] = []
    columns: list[str] | None = None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.startswith("|"):
            columns = None
            continue
        cells = _cells(line)
        if columns is None:
            columns = cells
            continue
        if set(cells) <= {"---", ":---", "---:"} or not {"hack", "guard", "candidates"} <= set(columns):
            continue
        if len(cells) != len(columns):
            raise CatalogError(f"{path.name} line {number}: {len(cells)} cells, the header has {len(columns)}")
        row = dict(zip(columns, cells))
        where = f"{path.name} line {number}"
        guards = tuple(filter(None, (guard.strip() for guard in row["guard"].split(","))))
        if not guards:
            raise CatalogError(f"{where}: no guard named for {row['hack']!r}")
        description = row.get("what it looks like") or f"seen in: {row.get('source', 'the harness')}"
        hacks.append(Hack(row["hack"], description, guards, _candidates(row["candidates"], where)))
    if not hacks:
        raise CatalogError(f"{path} has no table with hack, guard and candidates columns")
    return hacks
