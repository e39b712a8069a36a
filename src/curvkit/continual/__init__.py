"""Continual-learning harness: task streams and schedules, learners (MESU/BGD adapters, fine-tuning, EWC,
online EWC, SI), the online/EWC/non-online Laplace penalties (``LaplacePenalty``), evaluation on all tasks, checkpoint/resume (MESU paper Fig. 3; issue 3 section 3)."""

from curvkit.continual.laplace import LaplacePenalty, MultiHead
from curvkit.continual.learners import Learner, MeanFieldLearner, TorchLearner
from curvkit.continual.penalties import EWC, Penalty, SynapticIntelligence, diagonal_fisher
from curvkit.continual.runner import ContinualRunner, RunnerConfig, RunResult
from curvkit.continual.streams import (
    AbruptSchedule,
    Batch,
    ContinuousSchedule,
    DatasetSequence,
    PermutedTasks,
    Schedule,
    SplitTasks,
    TaskSet,
    TaskStream,
    iters_per_epoch,
)

__all__ = [
    "EWC",
    "AbruptSchedule",
    "Batch",
    "ContinualRunner",
    "ContinuousSchedule",
    "DatasetSequence",
    "LaplacePenalty",
    "Learner",
    "MeanFieldLearner",
    "MultiHead",
    "Penalty",
    "PermutedTasks",
    "RunResult",
    "RunnerConfig",
    "Schedule",
    "SplitTasks",
    "SynapticIntelligence",
    "TaskSet",
    "TaskStream",
    "TorchLearner",
    "diagonal_fisher",
    "iters_per_epoch",
]
