"""The feasibility check's wiring: what the later stages will take from each variant (read from their
params), the train stage's verdict in reports/feasibility.csv, and the stages reading it back.

The check itself is :func:`tasks.training.feasibility.check_feasibility`; the train stage runs it
after tokenizing the curated variants and before training (flows/train.py), ``scalelab plan``
shows it (flows/plan.py), and every later stage treats a series it left out as absent
(:func:`left_out`), saying why instead of failing.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from flows.runtime import Context
from flows.stage import write_table
from tasks.common.tracking import TrackedRun
from tasks.compression.config import CompressionConfig
from tasks.compression.pruning import PruningConfig
from tasks.sparse.registry import SparseEvalConfig
from tasks.training.config import TrainingConfig
from tasks.training.design import ladder
from tasks.training.feasibility import (
    SKIPPED, Feasibility, FeasibilityError, WindowNeed, check_feasibility, sized_to_data, validation_shortfall,
)

FEASIBILITY_CSV = "feasibility.csv"
# a params section's stage name, where the two differ (`key` of flows/evaluate_models.trained_models)
SECTION_STAGE = {"compression": "compress", "pruning": "prune"}


def window_needs(ctx: Context) -> list[WindowNeed]:
    """The training tokens compress, prune and sparse_eval take from each variant in their ``variants``
    filter, under the context's preset (a stage that takes none has no need)."""
    comp = ctx.config(CompressionConfig, "compression")
    prune = ctx.config(PruningConfig, "pruning")
    sparse = ctx.config(SparseEvalConfig, "sparse_eval")
    needs = []
    if comp.calib_tokens:
        needs.append(WindowNeed(stage="compress", tokens=comp.calib_tokens,
                                what=f"compression.calib_tokens {comp.calib_tokens:,}",
                                keys=("compression.calib_tokens", "compression.variants"), series=comp.variants))
    rec = prune.recovery
    needs.append(WindowNeed(stage="prune", tokens=prune.calib_tokens + rec.tokens,
                            what=f"pruning.calib_tokens {prune.calib_tokens:,} + pruning.recovery.tokens {rec.tokens:,}",
                            keys=("pruning.calib_tokens", "pruning.recovery.tokens", "pruning.variants"),
                            series=prune.variants))
    if sparse.calib_tokens:
        needs.append(WindowNeed(stage="sparse_eval", tokens=sparse.calib_tokens,
                                what=f"sparse_eval.calib_tokens {sparse.calib_tokens:,}",
                                keys=("sparse_eval.calib_tokens", "sparse_eval.variants"), series=sparse.variants))
    return needs


def feasibility_frame(feas: Feasibility) -> pl.DataFrame:
    """reports/feasibility.csv: one row per (variant, stage) checked (columns even when empty)."""
    schema = {"variant": pl.String, "series": pl.String, "stage": pl.String, "tokens": pl.Int64, "need": pl.Int64,
              "status": pl.String, "reason": pl.String, "keys": pl.String}
    return pl.DataFrame(feas.rows(), schema=schema)


def feasibility_tags(feas: Feasibility) -> dict[str, str]:
    """MLflow tags of the train stage's run: the mode, and per variant not plainly ``ok`` its
    stage statuses and reasons (``scalelab.feasibility.dedup_gopher``)."""
    tags = {"scalelab.feasibility.mode": feas.mode}
    for variant in dict.fromkeys(c.variant for c in feas.problems):
        tags[f"scalelab.feasibility.{variant}"] = "; ".join(
            f"{c.stage} {c.status}: {c.reason}" for c in feas.checks if c.variant == variant and c.status != "ok")[:4900]
    return tags


def feasibility_lines(feas: Feasibility) -> list[str]:
    """One printable line per check that is not ``ok``, naming the keys that would change it."""
    return [f"{c.variant}: {c.stage} {c.status.upper()}: {c.reason} (keys: {', '.join(c.keys)})"
            for c in feas.problems]


def left_out(reports: Path, stage: str) -> dict[str, str]:
    """Trained series the train stage's feasibility check left out of ``stage`` (its ``train`` row
    skipped: out of every stage), each with the reason; empty when there is no reports/feasibility.csv."""
    path = Path(reports) / FEASIBILITY_CSV
    if not path.exists() or path.stat().st_size == 0:
        return {}
    table = pl.read_csv(path, infer_schema_length=None)
    if not table.height:
        return {}
    missing = [c for c in ("series", "stage", "status", "reason") if c not in table.columns]
    if missing:
        raise ValueError(f"{path}: missing column {missing[0]!r} (written by `scalelab run train`)")
    out: dict[str, str] = {}
    for r in table.filter((pl.col("status") == SKIPPED) & pl.col("stage").is_in(["train", stage])).iter_rows(named=True):
        for series in str(r["series"]).split():
            out.setdefault(series, f"{r['stage']}: {r['reason']}")
    return out


def checked_ladder(ctx: Context, cfg: TrainingConfig, tokens: dict[str, int], val_tokens: int,
                   run: TrackedRun | None = None) -> tuple[TrainingConfig, Feasibility]:
    """The train stage's check before any training: ``cfg`` sized to the data when
    ``feasibility.size_to_data`` asks, and each variant's ladder (``tokens``: variant -> training tokens).

    Prints every check that is not ``ok``; with ``run``, writes reports/feasibility.csv, tags the run
    and logs the sized budgets. Raises :class:`FeasibilityError` when the validation split cannot
    score a model, when ``mode: fail`` found a shortfall, or when no variant is left to train.
    """
    short = validation_shortfall(val_tokens, cfg.seq_len)
    if short:
        raise FeasibilityError(short)
    if cfg.feasibility.size_to_data:
        before = cfg.compute_budgets or cfg.token_budgets
        cfg, factor = sized_to_data(cfg, tokens)
        after = cfg.compute_budgets or cfg.token_budgets
        print(f"train: feasibility.size_to_data: budgets x{factor:.3g} to the smallest variant's tokens: "
              f"{list(before)} -> {list(after)}")
        if run is not None:
            run.log_params({"feasibility.budget_factor": factor, "feasibility.budgets": list(after)})
    feas = check_feasibility(cfg, ladder(cfg), tokens, window_needs(ctx))
    for line in feasibility_lines(feas):
        print(f"train: feasibility: {line}")
    if run is not None:
        write_table(ctx, "feasibility", feasibility_frame(feas), run)
        run.set_tags(feasibility_tags(feas))
        train = [c for c in feas.checks if c.stage == "train"]
        run.log_metrics({f"feasibility.variants_{s}": sum(c.status == s for c in train) for s in ("ok", "shrunk", "skipped")}
                        | {"feasibility.stage_skips": sum(c.stage != "train" and c.status == "skipped" for c in feas.checks)})
    if feas.failed:
        raise FeasibilityError(feas.message())
    if not feas.trained:
        raise FeasibilityError("no variant has the tokens for one point of the ladder; nothing to train:\n"
                               + "\n".join(f"  {line}" for line in feasibility_lines(feas)))
    return cfg, feas
