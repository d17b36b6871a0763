"""What a ladder will cost before it is trained: optimizer steps, training FLOPs and time on this machine.

:func:`ladder_cost` counts what a series' points take under the schedule: ``cosine`` trains each
point on its own; ``wsd`` trains one stable run per size to its last branch point plus each
branch's cooldown (Hägele et al. 2024), so a size costs ``max(decay_start) + sum(steps -
decay_start)`` steps rather than ``sum(steps)``. FLOPs use the one convention of
:func:`tasks.lm.model.model_flops_per_token` (``6 N + 12 L T d`` per token).

:func:`time_optimizer_steps` measures seconds per optimizer step of a rung here (a few AdamW steps on
random tokens, after one warm-up step); :func:`StepTimes.seconds` interpolates the other rungs
linearly in FLOPs per token between the smallest and the largest measured one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tasks.training.arms import training_arms
from tasks.training.config import TrainingConfig
from tasks.lm.model import ModelShape
from tasks.training.design import RunSpec, arch_specs, seed_sizes
from tasks.training.feasibility import trainable_tokens
from tasks.lm.model import build_model, model_flops_per_token

# The most FLOPs one timed step may cost (a few seconds on a CPU core); a larger rung is timed on
# fewer sequences per step and scaled up, one too large even for one sequence is not timed.
MAX_TIMED_STEP_FLOPS = 2e10


@dataclass(frozen=True, kw_only=True)
class SizeCost:
    """One size's share of a series: its optimizer steps and their training FLOPs."""

    size: str
    flops_per_token: float
    steps: int
    flops: float


def ladder_cost(cfg: TrainingConfig, specs: Sequence[RunSpec]) -> list[SizeCost]:
    """Steps and training FLOPs of ``specs`` per size under ``cfg.schedule`` (see the module docstring)."""
    by_size: dict[str, list[RunSpec]] = {}
    for s in specs:
        by_size.setdefault(s.size, []).append(s)
    out = []
    for size, group in by_size.items():
        if cfg.schedule == "wsd":
            stable = max(s.decay_start or 0 for s in group)
            steps = stable + sum(s.steps - (s.decay_start or 0) for s in group)
        else:
            steps = sum(s.steps for s in group)
        fpt = group[0].flops_per_token
        out.append(SizeCost(size=size, flops_per_token=fpt, steps=steps, flops=fpt * steps * cfg.tokens_per_step))
    return out


def time_optimizer_steps(shape: ModelShape, cfg: TrainingConfig, steps: int = 3,
                         max_flops: float = MAX_TIMED_STEP_FLOPS) -> float | None:
    """Seconds per optimizer step of ``shape`` under ``cfg`` (batch, accumulation, seq_len, arch) on
    this machine (CUDA when there is one): ``steps`` AdamW steps on random tokens after one warm-up
    step, on at most ``max_flops`` of work per timed step (fewer sequences, scaled back up).
    None when one sequence alone costs more than ``max_flops``."""
    fpt = model_flops_per_token(shape, cfg.seq_len, cfg.vocab_size, cfg.arch).total
    rows_total = cfg.batch_size * cfg.grad_accum
    rows = min(rows_total, int(max_flops // (fpt * cfg.seq_len)))
    if rows < 1:
        return None
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(shape, cfg.vocab_size, cfg.seq_len, cfg.arch).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(cfg.vocab_size, (rows, cfg.seq_len + 1), generator=gen).to(device)
    x, y = data[:, :-1], data[:, 1:]

    def step() -> None:
        logits = model(input_ids=x, use_cache=False).logits
        F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * rows_total / rows


@dataclass(frozen=True, kw_only=True)
class StepTimes:
    """Measured seconds per optimizer step at two rungs, ``(flops_per_token, seconds)`` each."""

    small: tuple[float, float]
    large: tuple[float, float]

    def seconds(self, flops_per_token: float) -> float:
        """Seconds per step of a rung: linear in FLOPs per token through the two measurements."""
        (f0, t0), (f1, t1) = self.small, self.large
        if f1 == f0:
            return t0
        return max(0.0, t0 + (t1 - t0) * (flops_per_token - f0) / (f1 - f0))


def measure_step_times(cfg: TrainingConfig, steps: int = 3) -> tuple[StepTimes | None, list[str]]:
    """Time the smallest and the largest rung of ``cfg.sizes`` (:func:`time_optimizer_steps`).

    Returns the times (None when a rung could not be timed) and the rungs' tags in that order."""
    def fpt(s: ModelShape) -> float:
        return model_flops_per_token(s, cfg.seq_len, cfg.vocab_size, cfg.arch).total

    shapes = sorted(cfg.sizes, key=fpt)
    ends = [shapes[0], shapes[-1]] if len(shapes) > 1 else [shapes[0]]
    times = [time_optimizer_steps(s, cfg, steps) for s in ends]
    if any(t is None for t in times):
        return None, [s.tag for s in ends]
    pairs = [(fpt(s), t) for s, t in zip(ends, times)]
    return StepTimes(small=pairs[0], large=pairs[-1]), [s.tag for s in ends]


@dataclass(frozen=True, kw_only=True)
class SeriesPlan:
    """What one trained series (a variant's arm: ``raw``, ``raw+repb``, ``raw+xlstm``) will train.

    ``tokens``: its variant's training tokens (None: unknown until curation); ``status``: the
    feasibility check's (``ok``, ``shrunk``, ``skipped``; ``unknown`` without tokens); ``points``:
    the ladder points it trains; ``steps``/``flops``: their cost under the schedule, extra seeds
    included; ``seconds``: that cost at the measured step times (None: not measured);
    ``repeats``: ``(point, epochs)`` of every point that makes more than one pass over the tokens.
    """

    series: str
    variant: str
    tokens: int | None
    status: str
    points: tuple[RunSpec, ...]
    steps: int
    flops: float
    seconds: float | None
    repeats: tuple[tuple[str, float], ...]


def series_plans(cfg: TrainingConfig, specs: Sequence[RunSpec], variants: Sequence[str],
                 tokens: dict[str, int] | None = None, ladders: dict[str, list[RunSpec]] | None = None,
                 statuses: dict[str, str] | None = None, times: StepTimes | None = None) -> list[SeriesPlan]:
    """One :class:`SeriesPlan` per series of ``variants`` (each variant's arms, in order).

    ``ladders``/``statuses``: the feasibility check's points and ``train`` status per variant (a
    variant absent from ``ladders`` trains nothing); without them every variant gets ``specs``.
    Extra seeds (``cfg.seeds``) retrain the plain arm's ``seed_sizes`` and count in its cost.
    """
    seeded = set(seed_sizes(cfg, list(specs)))
    out = []
    for variant in variants:
        points = list(specs) if ladders is None else list(ladders.get(variant, []))
        status = (statuses or {}).get(variant, "unknown" if tokens is None else "ok")
        usable = trainable_tokens(tokens[variant], cfg.seq_len) if tokens is not None else None
        for suffix, arm_cfg in training_arms(cfg, variant):
            arm = points if arm_cfg.arch == cfg.arch else arch_specs(points, arm_cfg)
            costs = ladder_cost(cfg, arm)
            extra = len(cfg.seeds) if not suffix else 0
            steps = sum(c.steps * (1 + (extra if c.size in seeded else 0)) for c in costs)
            flops = sum(c.flops * (1 + (extra if c.size in seeded else 0)) for c in costs)
            seconds = None if times is None else sum(
                c.steps * (1 + (extra if c.size in seeded else 0)) * times.seconds(c.flops_per_token) for c in costs)
            repeats = () if usable is None else tuple(
                (s.name, s.tokens_trained / usable if usable else math.inf) for s in arm if s.tokens_trained > usable)
            out.append(SeriesPlan(series=variant + suffix, variant=variant, tokens=None if tokens is None else tokens[variant],
                                  status=status, points=tuple(arm), steps=steps, flops=flops, seconds=seconds,
                                  repeats=repeats))
    return out
