"""What the stage pipeline (pipeline.py) hands back: a finished micro-batch's `PipelineStep`, the
callbacks its feeder (engine.py) sets for results and failures, and `PipelineFailed`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.verifier_cloud.scheduler import SchedulerOutput
from services.verifier_cloud.stages import StageItem


class PipelineFailed(RuntimeError):
    """A stage worker died, stalled or could not start."""


@dataclass
class PipelineStep:
    """One finished micro-batch, with each stage's compute span (time.monotonic(), comparable across processes)."""

    batch_id: int
    batched_tokens: int
    spans: list[tuple[int, float, float]]
    sent_at: float
    done_at: float

    @property
    def compute_s(self) -> float:
        """Sum of the stages' compute: the micro-batch's whole trip through the middle layers (see server.py)."""
        return sum(end - start for _, start, end in self.spans)


# (batch, the last stage's items in batch order, the step) -> None; (batch, reason) -> None
DoneCallback = Callable[[SchedulerOutput, list[StageItem], PipelineStep], None]
FailCallback = Callable[[SchedulerOutput, str], None]
