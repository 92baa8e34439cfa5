"""The DeepSeek-V3.2 lightning indexer as a serving engine calls it in decode.

Each of B sequences decodes `next_n` tokens (1, or 2 with multi-token prediction)
against its own context, whose keys sit in a paged cache: blocks of 64 tokens
anywhere in `kv_cache` [num_blocks, 64, D], listed in order by the sequence's row of
`block_table` [B, max_blocks] (int32), with `context_lens` [B] (int32, on the device)
saying how many tokens each sequence has. Query row r = b·next_n + j (token j of
sequence b) sees the causal prefix of its sequence, the first
context_lens[b] − next_n + 1 + j tokens, and keeps the `topk` of them with the highest

    I[r, n] = sum_h weights[r, h] · relu(q[b, j, h, :] · key_b[n, :])

as indices into the sequence's own context, −1 where the prefix is shorter than `topk`.
This is the interface of DeepGEMM's `fp8_paged_mqa_logits` followed by a top-k over
each row's valid prefix, which vLLM and SGLang call (skills/models/deepseek-v3.2.md).

Every workload is a batch of B sequences up to N tokens: "mixed" draws the lengths
per input seed from a long-tailed distribution (one sequence of N tokens, the others
from topk/8 up, at least one shorter than topk), with the total fixed by the workload so
its cost is too; "equal" gives every sequence N tokens, as the dense op's rows see one
context. Blocks are shuffled across the cache, rows of `block_table` past a
sequence's end point into other sequences' blocks, and every cache slot no sequence
owns holds keys eight times louder than the rest: a kernel that reads past a
sequence's end, or scores another sequence's blocks, selects them and is wrong.

Shapes are a bucket's, as a server allocates them: the block table is as wide, and
the cache as large, as lengths rounded up to `context_bucket` (4096 tokens on CUDA)
need, and a batch is padded with empty sequences (all −1 rows) to `batch_bucket`,
as a server pads it to a size it captured a graph for; it replays one graph inside a
bucket while its lengths change. A kernel that specializes on shapes compiles once a
bucket; one that specializes on lengths compiles every step, and the first-call guard
sees it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from runners.ops.base import Workload, make_generator, sample
from runners.ops.dsa_indexer_topk import SHAPES, DsaIndexerTopk, repeated_indices, term_scale, weighted_scores

BLOCK_SIZE = 64  # tokens per cache block: DeepSeek-V3.2's indexer cache as vLLM pages it
MIXES = ("mixed", "equal")
# How much louder the keys of slots no sequence owns are: loud enough that any row
# that scores them selects them.
_UNOWNED_GAIN = 8.0
# Cache blocks drawn at a time (64 MiB of float32 keys at D=128): the judge draws a fresh
# input set for every timed call, and a 256K batch's whole cache in float32 is 8 GiB,
# which beside three children at their share of an H200 ran it out of memory.
KEY_CHUNK_BLOCKS = 2048


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def mixed_lengths(batch: int, longest: int, total: int, low: int, short: int,
                  generator: torch.Generator) -> list[int]:
    """`batch` lengths summing to `total`, in an order drawn from `generator`: one of
    `longest`, one (with three or more) below `short`, which top-k pads, and the others
    long-tailed (log-uniform weights) within [low, longest]."""
    if batch <= 2:
        return [longest, total - longest][:batch]
    fixed = [longest, low + int(torch.randint(max(1, short - low), (1,), generator=generator))]
    rest = total - sum(fixed)
    draws = torch.rand(batch - 2, generator=generator, dtype=torch.float64)
    weights = torch.exp(draws * math.log(longest / low)) * low
    lengths = [min(longest, max(low, round(float(w)))) for w in weights * (rest / float(weights.sum()))]
    # Rounding and the clamps leave the sum a little off: move it back within the bounds.
    gap = rest - sum(lengths)
    for index in range(len(lengths)):
        if not gap:
            break
        room = (longest if gap > 0 else low) - lengths[index]
        step = min(gap, room) if gap > 0 else max(gap, room)
        lengths[index] += step
        gap -= step
    lengths += fixed
    order = torch.randperm(batch, generator=generator).tolist()
    return [lengths[index] for index in order]


def shuffled_block_table(owned: list[int], num_blocks: int, width: int,
                         generator: torch.Generator) -> torch.Tensor:
    """A block table [len(owned), width] (int64, on the CPU) in which sequence i owns
    `owned[i]` blocks of the `num_blocks`, shuffled across the cache, no block owned
    twice, and every entry past its own points at some other block, as unused entries
    of a server's table may."""
    order = torch.randperm(num_blocks, generator=generator)
    table = order[torch.randint(num_blocks, (len(owned), width), generator=generator)]
    start = 0
    for row, count in enumerate(owned):
        table[row, :count] = order[start:start + count]
        start += count
    return table


class DsaIndexerTopkPaged(DsaIndexerTopk):
    name = "dsa_indexer_topk_paged"
    title = "DSA indexer top-k, paged decode"
    description = (
        "The DeepSeek-V3.2 lightning indexer in decode, as vLLM and SGLang call it: each "
        "sequence's next_n query tokens against its own context in a paged key cache "
        "(64-token blocks listed by block_table, lengths in context_lens on the device), "
        "ReLU'd per-head dot products summed with per-head weights, then the top-k "
        "positions of each row's causal prefix, as indices into that sequence's context "
        "in any order, padded with -1 where the prefix is shorter than top-k. The block "
        "table and the cache are sized for the length's bucket (a multiple of 4096 tokens "
        "on CUDA), as a server allocates them, so entries past a sequence's end are many; "
        "a batch is padded with empty sequences (context_lens 0, rows all -1) to a "
        "multiple of 8 on CUDA."
    )
    signature = "forward(q, kv_cache, block_table, context_lens, weights, topk) -> LongTensor"
    sized_params = frozenset({"tokens", "num_blocks", "max_blocks", "bucket", "padded_batch"})
    # The block table is as wide, and the cache as large, as the bucket's lengths need;
    # a batch is padded with empty sequences to a multiple of 8 on CUDA, as vLLM pads a
    # batch to the sizes it captured graphs for.
    context_bucket = {"cpu": 2048, "cuda": 4096}
    batch_bucket = {"cpu": 4, "cuda": 8}
    # The end-to-end loop's steps a timed call: enough on CUDA that one replay of the
    # captured steps is a stretch of serving; few on a CPU, where each step is slow.
    decode_steps = {"cpu": 4, "cuda": 32}

    def default_context_lengths(self, device: str) -> list[int]:
        return {"cpu": [2048, 8192], "cuda": [4096, 65536, 262144]}[device]

    def default_batch_sizes(self, device: str) -> list[int]:
        return {"cpu": [8], "cuda": [64]}[device]

    def max_batch_size(self, device: str) -> int:
        return {"cpu": 16, "cuda": 128}[device]

    def build_workloads(
        self, device: str, context_lengths: list[int], batch_sizes: list[int]
    ) -> list[Workload]:
        """Mixed and equal batches at every size, and the mixed batch with two tokens
        per sequence (multi-token prediction) at the longest context."""
        found = []
        for context in context_lengths:
            for batch in batch_sizes:
                kinds = [("mixed", 1), ("equal", 1)]
                if context == context_lengths[-1]:
                    kinds.insert(1, ("mixed", 2))
                found += [self.workload(device, context, batch, mix, next_n) for mix, next_n in kinds]
        return found

    def workload(self, device: str, context: int, batch: int, mix: str, next_n: int) -> Workload:
        shape = SHAPES[device]
        low = max(next_n, shape["topk"] // 8)

        def total(longest: int, count: int) -> int:  # a mixed batch's others: a quarter of it
            return longest * count if mix == "equal" else longest + (count - 1) * max(low, longest // 4)

        # Shapes are the buckets' (context_bucket, batch_bucket): the table as wide as the
        # longest sequence of the length bucket needs, the cache as large as a batch of the
        # batch bucket of that mix needs; each sequence's last block is partly empty, so a
        # mix has a block more per sequence.
        bucket, padded = self.bucketed(device, context), self.padded_batch(device, batch)
        blocks = (padded * blocks_for(bucket) if mix == "equal"
                  else blocks_for(total(bucket, padded)) + padded)
        name = f"ctx={context},b={batch}" if mix == "equal" else f"ctx<={context},b={batch},mixed"
        return Workload(
            name=name + (f",next_n={next_n}" if next_n > 1 else ""), device=device,
            params={"context_length": context, "batch": batch, "next_n": next_n, "mix": mix,
                    "padded_batch": padded,
                    "tokens": total(context, batch), "min_length": low, "bucket": bucket,
                    "num_blocks": blocks, "max_blocks": blocks_for(bucket), "block_size": BLOCK_SIZE,
                    **shape},
        )

    # -- inputs -------------------------------------------------------------------------

    def make_inputs(self, workload: Workload, seed: int, distribution: str) -> dict[str, Any]:
        return self.sample_paged(workload, seed, distribution, torch.bfloat16)

    def sample_paged(self, workload: Workload, seed: int, distribution: str, value_dtype: torch.dtype,
                     store_keys: Callable[[torch.Tensor], dict[str, torch.Tensor]] | None = None,
                     ) -> dict[str, Any]:
        """The batch's inputs with q in `value_dtype` and the layout of the module's
        docstring. The keys are drawn in float32 a chunk of blocks at a time and stored by
        `store_keys` (a chunk [blocks, 64, D] to the tensors the op keeps for it, each
        [blocks, ...]; default: kv_cache in `value_dtype`), so the cache is never whole in
        float32."""
        p = workload.params
        batch, next_n, heads, dim = p["batch"], p["next_n"], p["heads"], p["head_dim"]
        generator = make_generator(seed, workload.device)
        layout = torch.Generator().manual_seed(seed)  # lengths and blocks: the same on every device
        if p["mix"] == "equal":
            lengths = [p["context_length"]] * batch
        else:
            typical = (p["tokens"] - p["context_length"]) // max(1, batch - 1)
            lengths = mixed_lengths(batch, p["context_length"], p["tokens"], p["min_length"],
                                    min(p["topk"], typical), layout)
        # The padding sequences of the batch's bucket are empty: their rows are all -1.
        lengths += [0] * (p["padded_batch"] - batch)
        batch = p["padded_batch"]
        block_table = shuffled_block_table([blocks_for(length) for length in lengths],
                                           p["num_blocks"], p["max_blocks"], layout)
        owned = torch.zeros(p["num_blocks"], BLOCK_SIZE, dtype=torch.bool)
        for row, length in enumerate(lengths):
            owned.view(-1)[(block_table[row, :blocks_for(length), None] * BLOCK_SIZE
                            + torch.arange(BLOCK_SIZE)).view(-1)[:length]] = True
        draw = lambda shape, dtype: sample(  # noqa: E731
            shape, generator=generator, distribution=distribution, dtype=dtype)
        store_keys = store_keys or (lambda keys: {"kv_cache": keys.to(value_dtype)})
        gain = torch.where(owned, 1.0, _UNOWNED_GAIN).to(workload.device)
        stored: dict[str, torch.Tensor] = {}
        for start in range(0, p["num_blocks"], KEY_CHUNK_BLOCKS):
            count = min(KEY_CHUNK_BLOCKS, p["num_blocks"] - start)
            keys = draw((count, BLOCK_SIZE, dim), torch.float32) * gain[start:start + count].unsqueeze(-1)
            for name, part in store_keys(keys).items():
                if name not in stored:
                    stored[name] = part.new_empty((p["num_blocks"], *part.shape[1:]))
                stored[name][start:start + count] = part
        return {
            "q": draw((batch, next_n, heads, dim), value_dtype),
            **stored,
            "block_table": block_table.to(torch.int32).to(workload.device),
            "context_lens": torch.tensor(lengths, dtype=torch.int32, device=workload.device),
            "weights": draw((batch * next_n, heads), torch.float32) * heads**-0.5,
            "topk": p["topk"],
        }

    def nearly(self, inputs: Mapping[str, Any], other: Mapping[str, Any],
               generator: torch.Generator) -> dict[str, Any]:
        """Two keys of every sequence replaced by the other set's, made louder than any
        key of the cache: each scores far above or below the rest of its rows, so where
        it scores above it moves into their top-k, and an answer kept from the inputs
        these came from is wrong (outliers in the draw cannot hide it)."""
        changed = {key: value.clone() if isinstance(value, torch.Tensor) else value
                   for key, value in inputs.items()}
        lengths = changed["context_lens"].tolist()
        # Measured once, before any key is replaced: each louder key is as loud as the
        # first (louder than the last would grow them fourfold each, to overflow).
        loudest = self._loudest(changed)
        for row, length in enumerate(lengths):
            if not length:  # a padding sequence has no key to change
                continue
            for position in torch.randint(length, (2,), generator=generator).tolist():
                block = int(changed["block_table"][row, position // BLOCK_SIZE])
                self._louder_slot(changed, other, block, position % BLOCK_SIZE, loudest)
        return changed

    def _loudest(self, inputs: Mapping[str, Any]) -> float:
        # Two reductions, no copy: a float32 copy of a 64 x 256K cache is 8 GiB.
        keys = inputs["kv_cache"]
        return max(float(keys.amax()), -float(keys.amin()))

    def _louder_slot(self, changed: dict[str, Any], other: Mapping[str, Any], block: int,
                     slot: int, loudest: float) -> None:
        """The other set's key at (block, slot), scaled to four times `loudest`."""
        cache = changed["kv_cache"]
        key = other["kv_cache"][block, slot].float()
        cache[block, slot] = (key * (4 * loudest / float(key.abs().amax().clamp_min(1e-30)))).to(cache.dtype)

    # -- the reference and the check ------------------------------------------------------

    @staticmethod
    def prefix_lengths(inputs: Mapping[str, Any]) -> torch.Tensor:
        """How many tokens each query row sees: [B·next_n], int64, on the inputs' device
        (none for an empty sequence's rows)."""
        next_n = inputs["q"].shape[1]
        lengths = inputs["context_lens"].long().view(-1, 1)
        return (lengths - next_n + 1 + torch.arange(next_n, device=lengths.device)).view(-1).clamp_min(0)

    def gathered_keys(self, inputs: Mapping[str, Any], row: int, length: int) -> torch.Tensor:
        """Sequence `row`'s first `length` keys, in float32, from its blocks."""
        blocks = inputs["block_table"][row, :blocks_for(length)].long()
        return inputs["kv_cache"][blocks].reshape(-1, inputs["kv_cache"].shape[-1])[:length].float()

    def reference(self, inputs: Mapping[str, Any]) -> torch.Tensor:
        """Every row's float32 scores over the widest context, −inf past its prefix."""
        return self._per_row(inputs, inputs["weights"])

    def magnitudes(self, inputs: Mapping[str, Any]) -> torch.Tensor:
        """The dense op's term sizes per row's prefix (0 past it)."""
        return self._per_row(inputs, inputs["weights"].abs()).nan_to_num(neginf=0.0)

    def _per_row(self, inputs: Mapping[str, Any], weights: torch.Tensor) -> torch.Tensor:
        q = inputs["q"].float()
        batch, next_n = q.shape[:2]
        width = inputs["block_table"].shape[1] * BLOCK_SIZE
        prefixes = self.prefix_lengths(inputs)
        scores = torch.full((batch * next_n, width), float("-inf"), device=q.device)
        for row, length in enumerate(inputs["context_lens"].tolist()):
            keys = self.gathered_keys(inputs, row, length)
            for token in range(next_n):
                r = row * next_n + token
                seen = int(prefixes[r])
                if not seen:
                    continue
                scores[r, :seen] = weighted_scores(q[row, token:token + 1], keys[:seen], weights[r:r + 1])[0]
        return scores

    def check(
        self, output: torch.Tensor, reference_output: torch.Tensor, inputs: Mapping[str, Any]
    ) -> tuple[bool, str]:
        scores = reference_output
        rows = scores.shape[0]
        topk = inputs["topk"]
        if output.dtype != torch.int64:
            return False, f"output dtype is {output.dtype}, expected torch.int64 (indices)"
        if tuple(output.shape) != (rows, topk):
            return False, f"output shape is {list(output.shape)}, expected [{rows}, {topk}]"
        prefixes = self.prefix_lengths(inputs).to(output.device)
        padding = output == -1
        outside = ~padding & ((output < 0) | (output >= prefixes.unsqueeze(1)))
        if bool(outside.any()):
            row = int(outside.any(dim=1).nonzero()[0])
            return False, (
                f"{int(outside.sum()):,} indices are outside their row's prefix; row {row} "
                f"sees {int(prefixes[row])} tokens and returns {int(output[row][outside[row]][0])}"
            )
        wanted_padding = (topk - prefixes).clamp_min(0)
        wrong = padding.sum(dim=1) != wanted_padding
        if bool(wrong.any()):
            row = int(wrong.nonzero()[0])
            return False, (
                f"{int(wrong.sum()):,} rows are padded wrongly; row {row} sees "
                f"{int(prefixes[row])} tokens, so it needs exactly {int(wanted_padding[row])} "
                f"entries of -1, and has {int(padding[row].sum())}"
            )
        # −1s are distinct from every index and from each other here: only real repeats count.
        repeated = repeated_indices(
            torch.where(padding, -2 - torch.arange(topk, device=output.device), output))
        if repeated is not None:
            return False, repeated
        ranked = scores.gather(1, output.clamp_min(0)).masked_fill(padding, float("-inf")).sort(
            dim=1, descending=True)
        got = ranked.values
        top = scores.topk(topk, dim=1)
        want = top.values
        real = torch.isfinite(want)
        rtol, atol = self.tolerance(inputs["q"].dtype)
        # As the dense op's check measures a gap (term_scale).
        scale = term_scale(want, self.magnitudes(inputs), output.gather(1, ranked.indices), top.indices)
        gap = (got - want).abs().masked_fill(~real, 0)
        beyond = gap > atol * scale + rtol * want.abs().masked_fill(~real, 0)
        if bool(beyond.any()):
            row, rank = (int(i) for i in beyond.nonzero()[0])
            return False, (
                f"{int(beyond.sum()):,} of {int(real.sum()):,} selected scores fall short of "
                f"the true top-{topk} of their prefix beyond rtol={rtol:g}, atol={atol:g}×(row max "
                f"or terms' size); row {row}: the #{rank + 1} selected score is {float(got[row, rank]):.6g}, "
                f"the true #{rank + 1} is {float(want[row, rank]):.6g}"
            )
        worst = float((gap / scale).max())
        short = int((prefixes < topk).sum())
        return True, (f"top-{topk} scores of every prefix match ({short} rows shorter than "
                      f"top-k, padded); worst gap {worst:.3g} of the row max or the terms' size")

    # -- cost -------------------------------------------------------------------------------

    def flops(self, workload: Workload) -> int:
        p = workload.params
        # Every token of every sequence is scored by each of its next_n rows.
        per_head = 2 * p["head_dim"] + 3
        return p["next_n"] * p["tokens"] * p["heads"] * per_head

    def bytes(self, workload: Workload) -> int:
        p = workload.params
        rows = p["batch"] * p["next_n"]
        return (
            2 * rows * p["heads"] * p["head_dim"]
            + 2 * p["tokens"] * p["head_dim"]  # each sequence's own keys, read once
            # the table's entries each sequence needs, and the lengths
            + 4 * (blocks_for(p["tokens"]) + 2 * p["batch"])
            + 4 * rows * p["heads"]
            + 8 * rows * p["topk"]
        )


OP = DsaIndexerTopkPaged(Path(__file__).parent)
