"""A pre-registered check at larger scale: predict Delta beyond the ladder, then train there and score it.

Run: ``scalelab validate [--preset demo] [--workdir DIR]`` (``make validate``) after a finished
pipeline; not part of ``make demo``.

1. Fit the joint shared-shape law to the trained ladder (reports/train.csv; ``fit.decisions``) and
   write, before anything is trained, the predicted Delta against the reference and its interval
   for every compared series at the validation point (``fit.validation``: a model of about 2.4x the
   top rung's N trained on ``budget_multiple`` x the ladder's largest budget) to
   ``reports/validation/predictions.json``. An existing prediction is never overwritten: the check
   is scored against what was written first (``--force`` starts over).
2. Train that point on the reference and every compared series with the ladder's own recipe, and
   score the whole validation split per document.
3. Observed Delta with the document bootstrap and the ladder's seed noise (``sigma_seed`` from
   reports/val_docs.parquet); *hit* when the prediction interval (the joint fit's paired bootstrap
   plus one pair's seed noise, written in step 1) covers it. Writes
   ``reports/validation/validation.csv`` and prints the table.
"""

from __future__ import annotations

import dataclasses
import datetime
from pathlib import Path

import polars as pl
from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from flows.fit import gather_points
from flows.runtime import config_hash, map_tasks
from flows.stage import stage_context, stage_run, write_table
from tasks.common.io import read_json, write_json
from tasks.common.parallel import set_process_threads
from tasks.common.provenance import git_state
from tasks.scaling.compute_optimal import fit_flops_per_token
from tasks.scaling.config import FitConfig
from tasks.scaling.decisions import (
    WHOLE_SPLIT, doc_losses, document_weights, paired_difference, seed_sigma_delta, series_points, with_budget,
)
from tasks.scaling.joint import ExponentGrid, bootstrap_joint, fit_joint, point_differences
from tasks.training.arms import training_arms
from tasks.training.config import TrainingConfig
from tasks.lm.model import ModelShape
from tasks.training.design import RunSpec, ladder
from tasks.training.loop import read_doc_losses, train_model
from tasks.lm.model import model_flops_per_token
from tasks.training.tokenizer import load_tokens

PREDICTIONS = "predictions.json"


def validation_spec(train_cfg: TrainingConfig, cfg: FitConfig, largest_budget: float) -> RunSpec:
    """The validation point: ``fit.validation``'s shape on ``budget_multiple`` x the ladder's largest
    budget, with the ladder's schedule (peak lr of its width, warmup, WSD cooldown)."""
    v = cfg.validation
    shape = ModelShape(d_model=v.d_model, n_layers=v.n_layers, n_heads=v.n_heads)
    per_token = model_flops_per_token(shape, train_cfg.seq_len, train_cfg.vocab_size, train_cfg.arch).total
    tokens = int(v.budget_multiple * largest_budget / per_token)
    one = dataclasses.replace(train_cfg, sizes=(shape,), compute_budgets=(), token_budgets=(tokens,),
                              seeds=(), seed_sizes=(), extra_branches=())
    (spec,) = ladder(one)
    return spec


def predict(points: pl.DataFrame, cfg: FitConfig, spec: RunSpec, run_sd: float | None) -> dict:
    """The pre-registered prediction: the joint fit on the ladder, its paired bootstrap, Delta at
    (N, D) of ``spec`` per compared series; with ``run_sd`` (the ladder's seed spread of a one-seed
    Delta) also the prediction interval for the one pair the check trains."""
    d = cfg.decisions
    runs = points.filter(pl.col("series") == "trained") if "series" in points.columns else points
    trained = sorted(runs["variant"].unique().to_list())
    if d.reference not in trained:
        raise ValueError(f"fit.decisions.reference: {d.reference!r} was not trained (trained series: {trained})")
    compared = list(d.compared) or [v for v in trained if v != d.reference]
    grid = ExponentGrid(d.grid_lo, d.grid_hi, d.grid_steps, d.zoom_steps)
    data = series_points(runs, [d.reference, *compared])
    fit = fit_joint(data, shared=d.shared, grid=grid)
    boot = bootstrap_joint(data, fit, n_bootstrap=d.fit_bootstrap, seed=d.seed, grid=grid)
    rows = point_differences(fit, boot, d.reference, compared, spec.n_params_total, spec.tokens_trained,
                             d.confidence, run_sd=run_sd, seed=d.seed)
    return {"written_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git": git_state(str(Path(__file__).resolve().parents[1])), "run": spec.name, "n_params_total": spec.n_params_total,
            "tokens": spec.tokens_trained, "flops": spec.tokens_trained * spec.flops_per_token,
            "reference": d.reference, "confidence": d.confidence, "joint": fit.to_dict(), "run_sd": run_sd,
            "n_bootstrap": d.fit_bootstrap, "predictions": rows}


@task(name="validate-point", retries=0, cache_policy=NO_CACHE)
def train_point(variant: str, spec: RunSpec, cfg: TrainingConfig, train_path: str, val_path: str,
                val_docs_path: str, out_dir: str) -> dict:
    """Train the validation point on one series' tokens and return its per-document losses."""
    set_process_threads(cfg.num_threads)
    result = train_model(spec, cfg, load_tokens(train_path), load_tokens(val_path), out_dir,
                         val_docs=load_tokens(val_docs_path, mmap=False))
    return {"variant": variant, "val_loss": result.val_loss, "epochs": result.epochs, "wall_s": result.wall_s,
            "doc_losses": read_doc_losses(out_dir)}


@flow(name="validate", log_prints=True)
def validate_flow(root: str = ".", preset: str | None = None, workdir: str | None = None, runner: str | None = None,
                  force: bool = False) -> list[dict]:
    ctx = stage_context(root, preset, workdir, runner, None)
    cfg = ctx.config(FitConfig, "fit")
    train_cfg = ctx.config(TrainingConfig, "training")
    layout = ctx.layout
    out = layout.reports / "validation"
    with stage_run(ctx, "validate", cfg) as run:
        gathered = gather_points(layout.reports, cfg)
        runs, _ = with_budget(gathered.points.filter(pl.col("series") == "trained"))
        largest = float(runs["compute_budget"].max()) if runs["compute_budget"].drop_nulls().len() else float(runs["C"].max())
        spec = validation_spec(train_cfg, cfg, largest)
        ladder_docs = layout.reports / "val_docs.parquet"
        sigma = (seed_sigma_delta(doc_losses(pl.read_parquet(ladder_docs), WHOLE_SPLIT), cfg.decisions.reference)[0]
                 if ladder_docs.exists() else None)
        path = out / PREDICTIONS
        if path.exists() and not force:
            prediction = read_json(path)
            if prediction["run"] != spec.name:
                raise ValueError(f"{path}: pre-registered for {prediction['run']}, but fit.validation now asks for "
                                 f"{spec.name}; run with --force to predict again (the old prediction is replaced)")
            print(f"validate: scoring against the prediction written {prediction['written_at']} ({path})")
        else:
            prediction = predict(gathered.points, cfg, spec, sigma)
            write_json(path, prediction)
            print(f"validate: predictions for {spec.name} (N {spec.n_params_total:,}, D {spec.tokens_trained:,}) "
                  f"written to {path} before training")
        names = [prediction["reference"], *(p["variant"] for p in prediction["predictions"])]
        data_variant = {r["variant"]: r.get("data_variant") or r["variant"]
                        for r in pl.read_csv(layout.reports / "train.csv").iter_rows(named=True)}
        jobs = []
        for v in names:
            # a series' own recipe: the plain arm, or e.g. raw+repb's (training_arms), on its data's tokens
            arms = {data_variant[v] + suffix: arm for suffix, arm in training_arms(train_cfg, data_variant[v])}
            arm_cfg = arms.get(v)
            if arm_cfg is None or arm_cfg.arch != train_cfg.arch:
                raise ValueError(f"validate: {v} has no arm of training.arch {train_cfg.arch!r} to train at "
                                 f"{spec.name} (another architecture's N differs); leave it out with fit.decisions.compared")
            folder = layout.workdir / "models" / "validation" / v / f"{spec.name}-{config_hash(arm_cfg, spec)}"
            jobs.append(dict(variant=v, spec=spec, cfg=arm_cfg, train_path=str(layout.tokens / f"{data_variant[v]}.npy"),
                             val_path=str(layout.tokens / "val.npy"), val_docs_path=str(layout.tokens / "val.docs.npy"),
                             out_dir=str(folder)))
        trained = {r["variant"]: r for r in map_tasks(ctx.pipeline, train_point, jobs)}
        docs = pl.concat([r["doc_losses"].with_columns(pl.lit(v).alias("variant"), pl.lit(spec.name).alias("run"),
                                                       pl.lit(0).alias("seed"), pl.lit("val").alias("source"))
                          for v, r in trained.items()]).select("variant", "run", "seed", "doc", "source", "tokens",
                                                                   "loss_sum")
        d = doc_losses(docs, WHOLE_SPLIT)
        weights = document_weights(len(d.docs), cfg.decisions.n_bootstrap, cfg.decisions.seed)
        table = []
        for p in prediction["predictions"]:
            v, ref = p["variant"], prediction["reference"]
            o = paired_difference(d, [(v, spec.name, 0)], [(ref, spec.name, 0)], weights, sigma_seed=sigma,
                                  confidence=cfg.decisions.confidence, seed=cfg.decisions.seed)
            table.append({"variant": v, "reference": ref, "run": spec.name, "N": spec.n_params_total,
                          "D": spec.tokens_trained, "predicted": p["delta"], "predicted_ci_low": p["ci_low"],
                          "predicted_ci_high": p["ci_high"], "predicted_pi_low": p.get("pi_low"),
                          "predicted_pi_high": p.get("pi_high"), "observed": o["delta"], "observed_ci_low": o["ci_low"],
                          "observed_ci_high": o["ci_high"],
                          # a single trained pair is checked against the prediction interval (the law's
                          # bootstrap plus one pair's seed noise); a prediction without it, the law's interval
                          "hit": bool(p.get("pi_low", p["ci_low"]) <= o["delta"] <= p.get("pi_high", p["ci_high"])),
                          "sign_right": bool((p["delta"] < 0) == (o["delta"] < 0)),
                          "epochs": trained[v]["epochs"], "loss": trained[v]["val_loss"],
                          "reference_loss": trained[ref]["val_loss"]})
        out.mkdir(parents=True, exist_ok=True)
        frame = write_table(ctx, "validation/validation", table, run)
        run.log_metrics({"hits": sum(r["hit"] for r in table), "pairs": len(table)})
        with pl.Config(tbl_rows=50, tbl_cols=12, float_precision=4):
            print(frame.select("variant", "reference", "predicted", "predicted_pi_low", "predicted_pi_high",
                               "observed", "observed_ci_low", "observed_ci_high", "hit"))
        print(f"validate: {sum(r['hit'] for r in table)} of {len(table)} predicted intervals cover the observed "
              f"Delta -> {out / 'validation.csv'}")
        return table
