"""The harness: is a candidate correct, and is it faster than the op's baseline?

The process that imports this package is the judge; candidates only ever run in child
processes (`runners.harness.worker`), which it starts, questions and ends.
"""

from __future__ import annotations

from runners.harness.children import Limits
from runners.harness.evaluate import UsageError, evaluate
from runners.harness.result import EvaluationResult, Guard, WorkloadResult

__all__ = ["EvaluationResult", "Guard", "Limits", "UsageError", "WorkloadResult", "evaluate"]
