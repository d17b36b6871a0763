"""``scalelab plan``: what the train stage will do, before anything is trained.

Run: ``scalelab plan --preset ci [--root R] [--workdir W]``; ``scalelab run all`` prints the same plan
before its train stage. With curated variants in the workdir, it tokenizes them as the train
stage does (the same cached files, data/tokenizer and data/tokens, so the stage reuses them) and
runs the feasibility check (:mod:`tasks.training.feasibility`) without writing its table;
without them it prints the ladder, its FLOPs and its time, and says that the tokens are unknown
until ``scalelab run curate``. Step times are measured here on a few optimizer steps of the
smallest and largest rung (:func:`tasks.training.plan.measure_step_times`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from flows.feasibility import feasibility_lines, window_needs
from flows.runtime import Context
from flows.train import ensure_tokenizer, ensure_tokens, ensure_val_tokens
from tasks.common.parallel import set_process_threads
from tasks.training.config import TrainingConfig
from tasks.training.design import RunSpec, ladder
from tasks.training.feasibility import Feasibility, check_feasibility, sized_to_data, validation_shortfall
from tasks.training.plan import SeriesPlan, StepTimes, measure_step_times, series_plans
from tasks.training.tokenizer import load_tokens


@dataclass(frozen=True)
class TrainPlan:
    """Everything ``scalelab plan`` prints: the (possibly data-sized) config and ladder, each
    series' plan, the feasibility check (None without curated data), the measured step times."""

    preset: str
    cfg: TrainingConfig
    specs: list[RunSpec]
    series: list[SeriesPlan]
    feasibility: Feasibility | None
    times: StepTimes | None
    timed: list[str]
    notes: list[str]
    workers: int


def curated_names(ctx: Context, cfg: TrainingConfig) -> list[str]:
    """The curated variants the train stage would train (``training.variants``, else every one); empty
    before curation."""
    curated = ctx.layout.curated
    have = sorted(p.name for p in curated.iterdir() if (p / "kept.parquet").exists()) if curated.is_dir() else []
    if not have:
        return []
    missing = [v for v in cfg.variants if v not in have]
    if missing:
        raise FileNotFoundError(f"training.variants names {missing[0]!r}, not among curated variants {have}")
    return list(cfg.variants) or have


def training_plan(ctx: Context, measure: bool = True) -> TrainPlan:
    """The train stage's plan for ``ctx``'s workdir and preset (see the module docstring)."""
    cfg = ctx.config(TrainingConfig, "training")
    layout, notes = ctx.layout, []
    variants = curated_names(ctx, cfg)
    tokens = feas = None
    if variants and sorted((layout.prepared / "train").glob("shard-*.parquet")):
        tokenizer = ensure_tokenizer(ctx, cfg)
        tokens = {v: len(load_tokens(ensure_tokens(tokenizer, layout.curated / v / "kept.parquet",
                                                   layout.tokens / f"{v}.npy", layout.tokenizer))) for v in variants}
        val, _, _ = ensure_val_tokens(tokenizer, layout.prepared / "val.parquet", layout.tokens / "val.npy",
                                      layout.tokenizer)
        if short := validation_shortfall(len(load_tokens(val)), cfg.seq_len):
            notes.append(f"the train stage will stop: {short}")
        if cfg.feasibility.size_to_data:
            before = cfg.compute_budgets or cfg.token_budgets
            cfg, factor = sized_to_data(cfg, tokens)
            notes.append(f"feasibility.size_to_data: budgets x{factor:.3g}, {list(before)} -> "
                         f"{list(cfg.compute_budgets or cfg.token_budgets)}")
        feas = check_feasibility(cfg, ladder(cfg), tokens, window_needs(ctx))
        notes += feasibility_lines(feas)
        if feas.failed:
            notes.append("training.feasibility.mode is fail: the train stage will stop before training")
    else:
        notes.append("tokens unknown until `scalelab run curate` (no curated variants in "
                     f"{layout.curated}): the ladder below is the preset's, unchecked against the data")
        variants = list(cfg.variants) or ["(each curated variant)"]
    specs = ladder(cfg)
    times, timed = None, []
    if measure:
        set_process_threads(cfg.num_threads)  # the stage's own threads per training process
        times, timed = measure_step_times(cfg)
        if times is None:
            notes.append(f"step times not measured: one sequence of {timed[-1]} costs more than this plan times")
    statuses = {c.variant: c.status for c in feas.checks if c.stage == "train"} if feas else None
    plans = series_plans(cfg, specs, variants, tokens=tokens, ladders=feas.ladders if feas and not feas.failed else None,
                         statuses=statuses, times=times)
    return TrainPlan(preset=ctx.preset, cfg=cfg, specs=specs, series=plans, feasibility=feas, times=times,
                     timed=timed, notes=notes, workers=ctx.pipeline.local_workers if ctx.pipeline.runner == "local" else 0)


def _flops(x: float) -> str:
    return f"{x:.2e}" if x else "0"


def _duration(s: float | None) -> str:
    if s is None:
        return "—"
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def print_plan(plan: TrainPlan, console: Any | None = None) -> None:
    """``plan`` as rich tables: the ladder (sizes, D per point, measured step time), then per series
    its tokens, status, points, largest D, FLOPs and time, then the notes and the points repeating data."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    cfg = plan.cfg
    design = (f"IsoFLOP, budgets {', '.join(f'{c:.3g}' for c in cfg.compute_budgets)} FLOPs"
              if cfg.compute_budgets else f"grid, token budgets {', '.join(f'{t:,}' for t in cfg.token_budgets)}")
    console.rule(f"[bold]Training plan: preset {plan.preset}")
    console.print(f"{len(plan.specs)} points ({design}); schedule {cfg.schedule}; {cfg.tokens_per_step:,} tokens "
                  f"per step; feasibility: {cfg.feasibility.mode}, max_epochs {cfg.feasibility.max_epochs:g}",
                  highlight=False)
    ladder_table = Table(title="Ladder", title_justify="left")
    for c in ("size", "N (total)", "D per point", "FLOPs/token", "s/step here"):
        ladder_table.add_column(c)
    by_size: dict[str, list[RunSpec]] = {}
    for s in plan.specs:
        by_size.setdefault(s.size, []).append(s)
    for size, group in by_size.items():
        step = plan.times.seconds(group[0].flops_per_token) if plan.times else None
        mark = " (measured)" if size in plan.timed and plan.times else ""
        ladder_table.add_row(size, f"{group[0].n_params_total:,}", ", ".join(f"{s.tokens_trained:,}" for s in group),
                             _flops(group[0].flops_per_token), (f"{step:.3f}{mark}" if step is not None else "—"))
    console.print(ladder_table)
    series_table = Table(title="Per series", title_justify="left")
    for c in ("series", "tokens", "status", "points", "largest D", "training FLOPs", "time here (1 worker)"):
        series_table.add_column(c)
    for p in plan.series:
        largest = max((s.tokens_trained for s in p.points), default=0)
        series_table.add_row(p.series, f"{p.tokens:,}" if p.tokens is not None else "unknown", p.status,
                             f"{len(p.points)} of {len(plan.specs)}", f"{largest:,}", _flops(p.flops),
                             _duration(p.seconds))
    console.print(series_table)
    total_flops = sum(p.flops for p in plan.series)
    total_s = sum(p.seconds for p in plan.series) if plan.times else None
    workers = f", ~{_duration(total_s / plan.workers)} with {plan.workers} workers" if total_s and plan.workers > 1 else ""
    console.print(f"Total: {_flops(total_flops)} training FLOPs, ~{_duration(total_s)} on one worker{workers} "
                  f"(extra seeds included; step times of {' and '.join(plan.timed) or 'no rung'} measured here, "
                  "others interpolated in FLOPs per token)", highlight=False)
    repeats = [(p.series, name, e) for p in plan.series for name, e in p.repeats]
    if repeats:
        console.print("[bold]Points that would repeat data[/bold] (epochs > 1):")
        for series, name, e in repeats:
            console.print(f"  {series}/{name}: {'no full window' if math.isinf(e) else f'{e:.2f} epochs'}",
                          highlight=False)
    elif plan.feasibility is not None:
        console.print("No point repeats data (every point trained is within one pass over its variant's tokens).")
    for note in plan.notes:
        console.print(f"• {note}", highlight=False)
