"""The ladder's design: which (size, token budget) points to train, and each point's schedule.

Two designs (:class:`~tasks.training.config.TrainingConfig`):

* **grid** — every size x every ``token_budgets`` entry;
* **IsoFLOP** — for each compute budget C (FLOPs under the one convention of
  :func:`tasks.lm.model.model_flops_per_token`), ``sizes_per_budget`` consecutive sizes of
  ``sizes`` centred on the size whose tokens per parameter at C is closest to
  ``tokens_per_param_guess``, each trained on ``D = C / flops_per_token(N)`` tokens (Hoffmann et
  al. 2022, Approach 2's IsoFLOP profiles). ``flops_per_token = 6 N_total + 12 L T d``, so this is
  ``C / 6N`` up to the attention term.

Every point also carries its schedule: the peak lr of its width (``TrainingConfig.lr_for``), its
warmup, and under ``schedule: wsd`` the step at which its cooldown starts — the step where it
branches off its size's stable run (Hägele et al. 2024). ``extra_branches`` adds, per ladder point
of D tokens, a cooldown branch at ``f * D`` tokens from the same stable run (:func:`anneal_points`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from typing import Any

from tasks.common.config import to_dict
from tasks.training.config import TrainingConfig
from tasks.lm.model import ModelShape
from tasks.lm.model import model_flops_per_token, parameter_counts


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One (model size, token budget) point. ``tokens`` is the budget D asked for; the run trains
    ``steps * tokens_per_step`` tokens (the budget rounded to whole steps, at least one).

    ``decay_start`` (WSD only) is the first cooldown step: steps ``[0, decay_start)`` are shared with
    the size's stable run. ``compute_budget`` is the IsoFLOP budget the point belongs to (None in
    a grid design; None for every ``anneal`` point).

    ``point`` is ``ladder`` for a point of the design and ``anneal`` for an extra cooldown branch of
    ``extra_branches``. It labels the point and changes none of its numbers, so it is left out of
    :meth:`key` (what folders and fingerprints are keyed by).
    """

    name: str
    size: str
    shape: ModelShape
    tokens: int
    n_params: int  # non-embedding N (Kaplan et al.)
    n_params_total: int = 0  # every weight (Hoffmann et al.)
    steps: int
    tokens_per_step: int
    lr: float = 0.0  # peak lr of this width
    warmup_steps: int = 0
    decay_start: int | None = None
    compute_budget: float | None = None
    flops_per_token: float = 0.0
    point: str = "ladder"  # ladder | anneal

    def key(self) -> dict[str, Any]:
        """The spec as run folders and fingerprints are keyed: every field but the ``point`` label."""
        return {k: v for k, v in self.to_dict().items() if k != "point"}

    @property
    def tokens_trained(self) -> int:
        return self.steps * self.tokens_per_step

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunSpec:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names} | {"shape": ModelShape(**d["shape"])})


def run_name(shape: ModelShape, tokens: int) -> str:
    """``d64_l2_D200000``: the shape tag and the token budget."""
    return f"{shape.tag}_D{tokens}"


def isoflop_points(cfg: TrainingConfig) -> list[tuple[ModelShape, int, float]]:
    """``(shape, tokens, C)`` for every point of the IsoFLOP design (``D = C / flops_per_token``)."""
    shapes = sorted(cfg.sizes, key=lambda s: parameter_counts(s, cfg.vocab_size, cfg.arch, cfg.seq_len).total)
    n_total = [parameter_counts(s, cfg.vocab_size, cfg.arch, cfg.seq_len).total for s in shapes]
    per_token = [model_flops_per_token(s, cfg.seq_len, cfg.vocab_size, cfg.arch).total for s in shapes]
    k = cfg.sizes_per_budget
    out = []
    for c in cfg.compute_budgets:
        # tokens per parameter of each size at this budget; centre the window on the closest to the guess
        miss = [abs(math.log(c / f / n / cfg.tokens_per_param_guess)) for f, n in zip(per_token, n_total)]
        centre = min(range(len(shapes)), key=miss.__getitem__)
        lo = min(max(0, centre - k // 2), len(shapes) - k)
        for i in range(lo, lo + k):
            out.append((shapes[i], max(1, round(c / per_token[i])), float(c)))
    return out


def ladder(cfg: TrainingConfig) -> list[RunSpec]:
    """Every point of the config's design with its schedule, ordered by N then D.

    Raises ``ValueError`` naming ``warmup_steps`` when a WSD warmup would run into a cooldown.
    """
    per_step = cfg.tokens_per_step
    if cfg.compute_budgets:
        points = isoflop_points(cfg)
    else:
        points = [(shape, tokens, None) for shape in cfg.sizes for tokens in cfg.token_budgets]
    seen: dict[tuple[str, int], tuple[ModelShape, int, float | None]] = {}
    for shape, tokens, c in points:  # two budgets can round to one point: train it once
        seen.setdefault((shape.tag, max(1, round(tokens / per_step))), (shape, tokens, c))
    raw = []
    for (_, steps), (shape, tokens, c) in seen.items():
        counts = parameter_counts(shape, cfg.vocab_size, cfg.arch, cfg.seq_len)
        raw.append(dict(name=run_name(shape, tokens), size=shape.tag, shape=shape, tokens=tokens,
                        n_params=counts.non_embedding, n_params_total=counts.total, steps=steps,
                        tokens_per_step=per_step, lr=cfg.lr_for(shape), compute_budget=c,
                        flops_per_token=model_flops_per_token(shape, cfg.seq_len, cfg.vocab_size, cfg.arch).total))
    specs = []
    shortest = min(r["steps"] for r in raw)
    for r in raw:
        if cfg.schedule == "wsd":
            warmup = cfg.warmup_steps if cfg.warmup_steps is not None else (
                math.ceil(cfg.warmup_frac * shortest) if cfg.warmup_frac > 0 else 0)
            decay_start = r["steps"] - max(1, round(cfg.cooldown_frac * r["steps"]))
            if warmup > decay_start:
                raise ValueError(f"warmup_steps: {warmup} warmup steps run into the cooldown of {r['name']} "
                                 f"(starts at step {decay_start}); lower warmup_steps/warmup_frac or raise the budget")
            specs.append(RunSpec(**r, warmup_steps=warmup, decay_start=decay_start))
        else:
            specs.append(RunSpec(**r, warmup_steps=cosine_warmup_steps(r["steps"], cfg.warmup_frac)))
    specs += anneal_points(cfg, specs)
    return sorted(specs, key=lambda s: (s.n_params_total, s.tokens))


def anneal_points(cfg: TrainingConfig, specs: list[RunSpec]) -> list[RunSpec]:
    """The extra cooldown branches of ``extra_branches`` (WSD): for every ladder point of D tokens
    and each fraction f, a point of ``round(f * D)`` tokens of the same size, cooling down over
    the last ``cooldown_frac`` of its own steps from the size's stable run (Hägele et al. 2024:
    any stable-run checkpoint can be annealed into a full run at the cost of its cooldown).

    A point of ``round(f * D / tokens_per_step)`` steps that a size already has (a ladder point or
    an earlier fraction's) is not repeated. Anneal points share their size's warmup and lr, have
    no ``compute_budget`` and ``point: anneal``. Raises ``ValueError`` naming ``extra_branches``
    when a point's cooldown would start inside the warmup.
    """
    if not cfg.extra_branches:
        return []
    per_step = cfg.tokens_per_step
    have = {(s.size, s.steps) for s in specs}
    out = []
    for spec in sorted(specs, key=lambda s: (s.n_params_total, s.tokens)):
        for f in cfg.extra_branches:
            tokens = max(1, round(f * spec.tokens))
            steps = max(1, round(tokens / per_step))
            if (spec.size, steps) in have:
                continue
            have.add((spec.size, steps))
            decay_start = steps - max(1, round(cfg.cooldown_frac * steps))
            name = run_name(spec.shape, tokens)
            if spec.warmup_steps > decay_start:
                raise ValueError(f"extra_branches: fraction {f} of {spec.name} gives {name} ({steps} steps), whose "
                                 f"cooldown starts at step {decay_start}, inside the {spec.warmup_steps} warmup "
                                 "steps; raise the fraction or lower warmup_steps")
            out.append(dataclasses.replace(spec, name=name, tokens=tokens, steps=steps, decay_start=decay_start,
                                           compute_budget=None, point="anneal"))
    return out


def arch_specs(specs: list[RunSpec], cfg: TrainingConfig) -> list[RunSpec]:
    """``specs`` recounted for ``cfg.arch``: the same points (name, shape, tokens, steps, schedule)
    with that architecture's parameter counts and FLOPs per token.

    An ``arch_compare`` arm trains the reference arm's points, so the two pair up run by run at
    equal steps; ``compute_budget`` stays the design budget the point belongs to (the arm's own
    training FLOPs are its ``flops_total``).
    """
    out = []
    for s in specs:
        counts = parameter_counts(s.shape, cfg.vocab_size, cfg.arch, cfg.seq_len)
        out.append(dataclasses.replace(
            s, n_params=counts.non_embedding, n_params_total=counts.total,
            flops_per_token=model_flops_per_token(s.shape, cfg.seq_len, cfg.vocab_size, cfg.arch).total))
    return out


def seed_sizes(cfg: TrainingConfig, specs: list[RunSpec]) -> list[str]:
    """Size tags the extra ``seeds`` retrain, in ladder order (empty when ``seeds`` is).

    Every size of ``specs`` when ``seed_sizes`` is empty. Raises ``ValueError`` naming
    ``seed_sizes`` when one of its sizes has no point in the ladder (an IsoFLOP design need not
    train every size), since those extra seeds would cover no point.
    """
    if not cfg.seeds:
        return []
    have = list(dict.fromkeys(s.size for s in specs))
    empty = [t for t in cfg.seed_sizes if t not in have]
    if empty:
        raise ValueError(f"seed_sizes: {empty[0]!r} has no point in the ladder, so its extra seeds would cover "
                         f"no point; sizes with points: {have}")
    return [t for t in have if not cfg.seed_sizes or t in cfg.seed_sizes]


def cosine_warmup_steps(total_steps: int, warmup_frac: float) -> int:
    return min(total_steps - 1, math.ceil(warmup_frac * total_steps)) if warmup_frac > 0 else 0


def lr_at(step: int, spec: RunSpec, cfg: TrainingConfig) -> float:
    """Learning rate of 0-based optimizer step ``step`` of ``spec`` (peak ``spec.lr``, warmup ``W``).

    Warmup (both schedules): ``lr * (step + 1) / W`` for ``step < W``.
    ``cosine``: ``lr_min + (lr - lr_min) (1 + cos(pi p)) / 2``, ``p = (step - W) / (steps - 1 - W)``,
    ``lr_min = lr * min_lr_ratio`` reached at the last step.
    ``wsd``: ``lr`` until ``decay_start = S0``, then over the ``K = steps - S0`` cooldown steps
    ``lr * (1 - p)`` (linear) or ``lr * (1 - sqrt(p))`` (``1-sqrt``, Hägele et al. 2024) with
    ``p = (step - S0 + 0.5) / K`` — the midpoint of each step, so the decay reaches 0 at the end
    of the run without a wasted step at lr 0.
    """
    lr, w = spec.lr, spec.warmup_steps
    if step < w:
        return lr * (step + 1) / w
    if cfg.schedule == "wsd":
        s0 = spec.decay_start if spec.decay_start is not None else spec.steps
        if step < s0:
            return lr
        p = min(1.0, (step - s0 + 0.5) / (spec.steps - s0))
        return lr * (1.0 - (p if cfg.cooldown_shape == "linear" else math.sqrt(p)))
    lr_min = lr * cfg.min_lr_ratio
    span = spec.steps - 1 - w
    p = (step - w) / span if span > 0 else 1.0
    return lr_min + (lr - lr_min) * 0.5 * (1.0 + math.cos(math.pi * min(p, 1.0)))


def stable_steps(specs: list[RunSpec]) -> list[int]:
    """The branch points of one size's WSD stable run: every distinct ``decay_start``, ascending."""
    return sorted({s.decay_start for s in specs if s.decay_start is not None})
