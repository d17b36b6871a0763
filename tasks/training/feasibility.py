"""Can each curated variant serve what the study asks of it? Checked after curation, before any training.

A variant's training tokens must hold

* its ladder: every point's D within ``feasibility.max_epochs`` passes over the tokens the sampler
  can draw (:func:`trainable_tokens`; a point beyond it repeats data, and the fit stage leaves such
  runs out at its own ``fit.max_epochs``);
* the windows later stages take from them (:class:`WindowNeed`): compress's and sparse_eval's
  calibration tokens, prune's calibration plus recovery tokens, for the series in each stage's
  ``variants`` filter.

:func:`check_feasibility` turns the token counts into one :class:`Check` per (variant, stage) and,
by ``feasibility.mode`` (:class:`~tasks.training.config.FeasibilityConfig`), the ladder each variant
trains: ``shrink`` keeps the points that fit and leaves a variant out of only the stages it cannot
feed, ``skip`` leaves a variant short of anything out of everything, ``fail`` marks every shortfall
``failed`` for the caller to raise :class:`FeasibilityError` on. :func:`sized_to_data` scales a
design's budgets to the data instead (``feasibility.size_to_data``).

    >>> feas = check_feasibility(cfg, ladder(cfg), {"raw": 2_000_000, "tiny": 508}, needs)
    >>> feas.ladders["raw"], feas.status("tiny", "train")
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tasks.training.arms import training_arms
from tasks.training.config import TrainingConfig
from tasks.training.design import RunSpec, ladder

STAGES = ("train", "compress", "prune", "sparse_eval")
OK, SHRUNK, SKIPPED, FAILED = "ok", "shrunk", "skipped", "failed"


class FeasibilityError(ValueError):
    """A variant cannot serve the study under ``training.feasibility.mode: fail``; the message names
    each variant, its tokens, what needed more and the params keys that would change it."""


@dataclass(frozen=True, kw_only=True)
class WindowNeed:
    """Training tokens a later stage takes from each variant it works on.

    ``stage``: compress | prune | sparse_eval; ``tokens``: how many; ``what``: how the params make
    that number (``pruning.calib_tokens 4096 + pruning.recovery.tokens 16384``); ``keys``: the
    params keys that would change it (the stage's ``variants`` filter among them); ``series``: the
    stage's ``variants`` filter (trained series such as ``raw`` or ``raw+repb``; empty = every one).
    """

    stage: str
    tokens: int
    what: str
    keys: tuple[str, ...]
    series: tuple[str, ...] = ()

    def applies(self, series: Sequence[str]) -> bool:
        return not self.series or any(s in self.series for s in series)


@dataclass(frozen=True, kw_only=True)
class Check:
    """One row of reports/feasibility.csv: what ``stage`` asks of ``variant`` and what happens.

    ``tokens``: the variant's training tokens (its token file); ``need``: what the stage asks for
    (train: the ladder's largest D over ``max_epochs``, compared with the tokens the sampler draws);
    ``status``: ok | shrunk (train: some points left out) | skipped (left out of ``stage``; the
    ``train`` row: of training and every later stage) | failed (``mode: fail``); ``series``: the
    trained series of the variant (``raw``, ``raw+repb``, ...), which the later stages filter on.
    """

    variant: str
    series: tuple[str, ...]
    stage: str
    tokens: int
    need: int
    status: str
    reason: str
    keys: tuple[str, ...]

    def row(self) -> dict:
        return {"variant": self.variant, "series": " ".join(self.series), "stage": self.stage, "tokens": self.tokens,
                "need": self.need, "status": self.status, "reason": self.reason, "keys": " ".join(self.keys)}


@dataclass(frozen=True)
class Feasibility:
    """The outcome of :func:`check_feasibility`: every check, and the ladder of each variant that trains."""

    mode: str
    checks: tuple[Check, ...]
    ladders: dict[str, list[RunSpec]]  # variant -> the points it trains; skipped and failed variants absent

    @property
    def trained(self) -> list[str]:
        return list(self.ladders)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == FAILED]

    @property
    def problems(self) -> list[Check]:
        """Every check that is not ``ok``, in table order."""
        return [c for c in self.checks if c.status != OK]

    def status(self, variant: str, stage: str) -> str | None:
        return next((c.status for c in self.checks if c.variant == variant and c.stage == stage), None)

    def rows(self) -> list[dict]:
        return [c.row() for c in self.checks]

    def message(self) -> str:
        """The failed checks, one line each (what :class:`FeasibilityError` says)."""
        lines = [f"  {c.variant}: {c.stage}: {c.reason} (change: {', '.join(c.keys)})" for c in self.failed]
        return ("training.feasibility.mode is fail and " + f"{len({c.variant for c in self.failed})} variant(s) "
                "cannot serve the study; nothing was trained:\n" + "\n".join(lines))


def trainable_tokens(n_tokens: int, seq_len: int) -> int:
    """Training tokens the sampler can draw from a stream of ``n_tokens``: whole windows of
    ``seq_len`` with room for the largest start shift (:class:`tasks.training.loop.WindowSampler`'s
    ``n_windows * seq_len``; 0 when not one window fits, which the sampler refuses)."""
    return max(0, (n_tokens - seq_len) // seq_len) * seq_len


def _budget_keys(cfg: TrainingConfig) -> tuple[str, ...]:
    design = "training.compute_budgets" if cfg.compute_budgets else "training.token_budgets"
    return (design, "training.feasibility.max_epochs", "training.feasibility.mode")


def _points(specs: Sequence[RunSpec]) -> str:
    names = [f"{s.name} ({s.tokens_trained:,} tokens)" for s in sorted(specs, key=lambda s: -s.tokens_trained)]
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more point(s)" if len(names) > 4 else "")


def check_feasibility(cfg: TrainingConfig, specs: Sequence[RunSpec], tokens: Mapping[str, int],
                      needs: Sequence[WindowNeed] = ()) -> Feasibility:
    """Check every variant of ``tokens`` (variant -> its training tokens, the token file's length)
    against ``specs`` (the ladder) and ``needs``, under ``cfg.feasibility``.

    Returns the checks in variant order (a ``train`` row per variant, then one per applicable
    need) and each trained variant's points (a subset of ``specs`` in their order, so model folders
    and fingerprints are those of the full ladder). Under ``fail`` nothing trains when a check failed;
    the caller raises :class:`FeasibilityError` with :meth:`Feasibility.message`.
    """
    mode, max_epochs = cfg.feasibility.mode, cfg.feasibility.max_epochs
    checks: list[Check] = []
    ladders: dict[str, list[RunSpec]] = {}
    largest = max(s.tokens_trained for s in specs)
    for variant, n in tokens.items():
        series = tuple(variant + suffix for suffix, _ in training_arms(cfg, variant))
        usable = trainable_tokens(n, cfg.seq_len)
        allowed = math.floor(max_epochs * usable)
        over = [s for s in specs if s.tokens_trained > allowed]
        need = math.ceil(largest / max_epochs)
        stage_rows = []
        for w in needs:
            if not w.applies(series):
                continue
            short = n < w.tokens
            status = (FAILED if mode == "fail" else SKIPPED) if short else OK
            reason = (f"{n:,} training tokens, needs {w.tokens:,} ({w.what})" if short
                      else f"{n:,} training tokens cover {w.what}")
            stage_rows.append(Check(variant=variant, series=series, stage=w.stage, tokens=n, need=w.tokens,
                                    status=status, reason=reason, keys=w.keys))
        short_stages = [c for c in stage_rows if c.status != OK]
        epochs = f"{max_epochs:g} pass(es) over its {usable:,} trainable tokens"
        if not over:
            status, reason = OK, f"every point fits {epochs}"
        elif mode == "fail":
            status, reason = FAILED, f"{_points(over)} need more than {epochs}"
        elif mode == "skip" or len(over) == len(specs):
            status = SKIPPED
            reason = (f"no point fits {epochs} (the smallest needs {min(s.tokens_trained for s in over):,})"
                      if len(over) == len(specs) else f"{_points(over)} need more than {epochs}")
        else:
            status, reason = SHRUNK, f"{len(specs) - len(over)} of {len(specs)} points kept; left out: {_points(over)}"
        if mode == "skip" and status == OK and short_stages:
            status = SKIPPED
            reason = "cannot serve " + ", ".join(c.stage for c in short_stages) + "; " + reason
        keys = _budget_keys(cfg)
        checks.append(Check(variant=variant, series=series, stage="train", tokens=n, need=need, status=status,
                            reason=reason, keys=keys))
        if status == SKIPPED:  # left out of training: every later stage goes without it
            stage_rows = [dataclasses.replace(c, status=SKIPPED, reason=f"not trained; {c.reason}")
                          if c.status == OK else c for c in stage_rows]
        checks += stage_rows
        if status in (OK, SHRUNK):
            ladders[variant] = [s for s in specs if s not in over]
    if mode == "fail" and any(c.status == FAILED for c in checks):
        ladders = {}
    return Feasibility(mode=mode, checks=tuple(checks), ladders=ladders)


def validation_shortfall(val_tokens: int, seq_len: int) -> str | None:
    """Why the shared validation split cannot score a model (fewer tokens than one window of
    ``seq_len`` plus its target), or None. Every variant is scored on it, so a shortfall stops all."""
    if val_tokens >= seq_len + 1:
        return None
    return (f"the validation split has {val_tokens:,} tokens, fewer than one window of training.seq_len "
            f"{seq_len} + 1; raise prepare.val_fraction (or prepare.val_docs) or lower training.seq_len")


def sized_to_data(cfg: TrainingConfig, tokens: Mapping[str, int]) -> tuple[TrainingConfig, float]:
    """``cfg`` with its design's budgets all scaled by one factor, the largest such that the ladder's
    largest D (whole steps, :attr:`RunSpec.tokens_trained`) fits ``feasibility.max_epochs`` passes
    over the smallest variant's trainable tokens; returns ``(config, factor)``.

    The factor can exceed 1 (a corpus larger than the preset assumes). Token budgets are rounded to
    whole tokens, compute budgets to 3 significant digits; an IsoFLOP design may move its size
    window with the budget, so the factor is lowered in 1% steps until the rounded ladder fits.
    Raises ``ValueError`` naming ``training.feasibility.size_to_data`` when not one step of the
    smallest model fits.
    """
    if not tokens:
        raise ValueError("training.feasibility.size_to_data: no variant to size the ladder to")
    smallest = min(tokens, key=tokens.get)
    target = math.floor(cfg.feasibility.max_epochs * trainable_tokens(tokens[smallest], cfg.seq_len))

    def scaled(f: float) -> TrainingConfig:
        if cfg.compute_budgets:
            return dataclasses.replace(cfg, compute_budgets=tuple(float(f"{c * f:.3g}") for c in cfg.compute_budgets))
        return dataclasses.replace(cfg, token_budgets=tuple(max(1, round(t * f)) for t in cfg.token_budgets))

    def largest_d(c: TrainingConfig) -> int:
        return max(s.tokens_trained for s in ladder(c))

    if target < cfg.tokens_per_step:
        raise ValueError(f"training.feasibility.size_to_data: {smallest!r} has {tokens[smallest]:,} tokens, "
                         f"{target:,} within max_epochs, less than one step of {cfg.tokens_per_step:,}; "
                         "curate more text or leave the variant out (training.variants)")
    factor = target / largest_d(cfg)
    for _ in range(200):
        out = scaled(factor)
        budgets = out.compute_budgets or out.token_budgets
        if len(set(budgets)) == len(budgets) and largest_d(out) <= target:
            return out, factor
        factor *= 0.99
    raise ValueError(f"training.feasibility.size_to_data: no scaling of the budgets fits {target:,} tokens "
                     f"({smallest!r}); set the budgets by hand")
