"""What the compress and sparse_eval stages share: the trained models to work on, and their data."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from flows.feasibility import SECTION_STAGE, left_out
from flows.runtime import Context
from flows.stage import FAILED, STATUS
from tasks.common.lineage import data_ref


def trained_models(ctx: Context, names: tuple[str, ...] = (), variants: tuple[str, ...] = (),
                   key: str = "variants") -> list[dict]:
    """Rows of reports/train.csv (variant, run, n_params, tokens, val_loss, model_dir), optionally by
    run name and by series (``variants``: the stage's ``<key>``, e.g. ``compression.variants``; empty
    = every trained series).

    Rows of runs that failed (``status`` failed: no model) are skipped. Rows with ``point == "anneal"`` (extra cooldown branches, ``training.extra_branches``) are
    skipped: they add points to the scaling laws, not models to compress, prune, sparsify or
    evaluate, so those stages' cost stays the ladder's. Series that the train stage's feasibility
    check left out of this stage (reports/feasibility.csv; the stage is ``key``'s section) are
    absent, not an error: each is named with the reason."""
    table = ctx.layout.reports / "train.csv"
    if not table.exists():
        raise FileNotFoundError(f"{table}: no trained models; run `scalelab run train` first")
    rows = [r for r in pl.read_csv(table).to_dicts()  # a diverged or failed run has no model
            if not r.get("diverged") and r.get("point") != "anneal" and r.get(STATUS) != FAILED]
    # Series the train stage's feasibility check left out of this stage are absent, with the reason said
    section = key.split(".")[0]
    stage = SECTION_STAGE.get(section, section)
    absent = left_out(ctx.layout.reports, stage)
    for series in sorted(s for s in absent if not variants or s in variants):
        print(f"{stage}: {series} left out by the feasibility check ({absent[series]})")
    if variants:
        trained = sorted({r["variant"] for r in rows})
        unknown = [v for v in variants if v not in trained and v not in absent]
        if unknown:
            raise ValueError(f"{key} names {unknown[0]!r}, not a trained series of {table} ({trained})")
        rows = [r for r in rows if r["variant"] in variants]
    rows = [r for r in rows if r["variant"] not in absent]
    if names:
        known = {r["run"] for r in rows}
        missing = [n for n in names if n not in known]
        if missing:
            raise FileNotFoundError(f"{table}: no trained run named {missing[0]!r}; runs: {sorted(known)}")
        rows = [r for r in rows if r["run"] in names]
    for r in rows:
        r["model_dir"] = str(ctx.workdir / r["model_dir"])
    return rows


def tokens_path(ctx: Context, model_row: dict) -> Path:
    """The training tokens of a row of reports/train.csv: its data variant's (``raw`` for ``raw+repb``)."""
    return ctx.layout.tokens / f"{model_row.get('data_variant') or model_row['variant']}.npy"


def val_tokens_path(ctx: Context) -> Path:
    return ctx.layout.tokens / "val.npy"


def model_datasets(ctx: Context, models: list[dict]) -> dict[str, tuple]:
    """Per series (``variant`` of a train.csv row): ``((training tokens, "training"), (validation
    tokens, "evaluation"))`` as MLflow datasets (:func:`tasks.common.lineage.data_ref`) with their
    contexts, for the runs that score its models."""
    val = data_ref(ctx.workdir, val_tokens_path(ctx), "val")
    out = {}
    for m in models:
        if m["variant"] not in out:
            train = data_ref(ctx.workdir, tokens_path(ctx, m), m.get("data_variant") or m["variant"])
            out[m["variant"]] = ((train, "training"), (val, "evaluation"))
    return out
