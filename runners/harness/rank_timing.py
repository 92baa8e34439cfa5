"""Timing two rank groups against each other: alternating rounds, on the judge's clock.

The collective judge times two things this way: the op's own calls at each message
size (runners.harness.collective) and whole calls of the tensor-parallel decode step,
its end-to-end check (runners.harness.collective_endtoend). Either way the rounds
alternate, baseline then candidate, until the budget is spent, so whatever slows the
machine meanwhile slows both sides alike. A round is SAMPLES_PER_ROUND calls on every
rank, each a request of the judge's to every rank (which lines them up) and each on an
input of its own, new every round (drawn from the secret seed, so no call's input was
seen before: a result kept from an earlier call is stale). Its sample is the judge's
own clock, from each request's first byte out to the last rank's reply in, averaged
over the round's calls: a collective is done when its slowest rank is, and no rank's
word on its own speed is taken (its process runs candidate code). After a secret sample
of rounds, and after the last, the judge reads back every output of the candidate's
round on every rank and checks it: a rank that skipped work while timed is wrong.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from runners.harness.children import BASELINE, CANDIDATE
from runners.harness.measure import REVALIDATE_RATE

if TYPE_CHECKING:
    from runners.harness.collective import RankGroup, RanksWatch

# Timed calls per round, each a request of its own to every rank (the line-up), each on
# an input of its own.
SAMPLES_PER_ROUND = 5
# A sample per round: enough of them for the bootstrap even on a short budget.
MIN_ROUNDS, MAX_ROUNDS = 20, 200


@dataclass(frozen=True)
class Round:
    """What the judge drew for one round, and how it checks what came back."""

    # (rank, call, ...): rank r is given shares[r] alone, one input per call.
    shares: torch.Tensor
    # (call, one rank's output of it) -> (right?, why not); the output is None where the
    # rank returned no tensor.
    check: Callable[[int, Any], tuple[bool, str]]


def time_rounds(groups: Mapping[str, RankGroup], watch: RanksWatch, *, label: str,
                budget_s: float, draw: Callable[[int], Round], picker: np.random.Generator,
                run: str = "forward", forwards_per_call: int = 1,
                ) -> tuple[dict[str, list[float]], list[str]]:
    """Times `label` in alternating rounds (`draw(n)`: round n's inputs); `run` is what
    each rank runs per call ("forward", or "step": a call of the decode step, with
    `forwards_per_call` forward calls in it). `picker`, the judge's own draw from a seed
    the ranks never see, picks the rounds whose outputs are read.

    Returns each side's samples (ms per call) and what was wrong in the outputs read."""
    times: dict[str, list[float]] = {BASELINE: [], CANDIDATE: []}
    wrong: list[str] = []
    during = f"timing {label}"
    started = time.monotonic()
    rounds = 0
    while rounds < MIN_ROUNDS or (time.monotonic() - started < budget_s and rounds < MAX_ROUNDS):
        drawn = draw(rounds)
        for role, group in groups.items():
            group.prepare_round(drawn.shares)
            if role == CANDIDATE:
                watch.traffic(group.traffic(), f"between requests, before {during}")
            spent_ns = 0
            for call in range(SAMPLES_PER_ROUND):
                sent = time.perf_counter_ns()
                answers = group.ask("time", during, index=call, run=run)
                spent_ns += time.perf_counter_ns() - sent
                if role == CANDIDATE:
                    for rank, (header, _) in enumerate(answers):
                        watch.calls += forwards_per_call
                        watch.note(rank, header, during)
            times[role].append(spent_ns / 1e6 / SAMPLES_PER_ROUND)
            if role == CANDIDATE:
                watch.traffic(group.traffic(), during)
        rounds += 1
        if picker.random() < REVALIDATE_RATE:
            wrong += timed_outputs(groups[CANDIDATE], drawn, label, rounds)
            if wrong:
                return times, wrong
    # The last round's outputs, whatever the draw: the candidate's ranks still hold them.
    wrong += timed_outputs(groups[CANDIDATE], drawn, label, rounds)
    return times, wrong


def timed_outputs(candidate: RankGroup, drawn: Round, label: str, round_number: int) -> list[str]:
    """Every output of the candidate's last round, on every rank, checked."""
    wrong = []
    answers = candidate.ask("outputs", f"reading timed outputs of {label}")
    for rank, (_, tensors) in enumerate(answers):
        for call in range(drawn.shares.shape[1]):
            ok, detail = drawn.check(call, tensors.get(f"output_{call}"))
            if not ok:
                wrong.append(f"{label}, timed round {round_number} call {call + 1}, "
                             f"rank {rank}: {detail}")
    return wrong
