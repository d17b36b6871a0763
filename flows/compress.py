"""Stage 3, compress: every enabled compression setting on every trained model.

Run: ``scalelab run compress [--preset ci]``. For each (model, setting): compress, score the
shared validation split, and write the packed model to ``models/compressed/<variant>/<run>/<setting>.safetensors``
(``bytes_on_disk`` is that file's size). Writes ``reports/compress.csv``; one MLflow run per pair.
"""

from __future__ import annotations

import math
from pathlib import Path

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from flows.evaluate_models import tokens_path, trained_models, val_tokens_path
from flows.runtime import map_tasks
from flows.stage import stage_context, stage_run, write_table
from tasks.common.config import to_dict
from tasks.common.io import atomic_dir
from tasks.common.tracking import RunRef, tracked_run
from tasks.compression.registry import CompressionConfig, compress, save_compressed
from tasks.evaluation.loss import evaluate_loss
from tasks.training.loop import load_model
from tasks.training.tokenizer import load_tokens


@task(name="compress-model", cache_policy=NO_CACHE)
def compress_model(model_row: dict, cfg: CompressionConfig, out_dir: str, parent: RunRef) -> list[dict]:
    """Every enabled setting on one trained model; one MLflow child run per setting."""
    model, meta = load_model(model_row["model_dir"])
    seq_len = cfg.seq_len or meta["seq_len"]
    val = load_tokens(model_row["val_path"])
    calib = load_tokens(model_row["train_path"])[: cfg.calib_tokens] if cfg.calib_tokens else None
    base_loss = evaluate_loss(model, val, seq_len, cfg.batch_size, max_tokens=cfg.eval_tokens)
    rows = []
    for setting, (method, mcfg) in cfg.methods().items():
        params = {
            "stage": "compress", "variant": model_row["variant"], "run": model_row["run"], "setting": setting,
            "method": method, "n_params": model_row["n_params"], "tokens": model_row["tokens"],
            "bits": getattr(mcfg, "bits", None), "group_size": getattr(mcfg, "group_size", None),
        }
        with tracked_run(f"compress:{model_row['variant']}:{model_row['run']}:{setting}", uri=parent.uri,
                         experiment=parent.experiment, parent=parent, params=params | {"config": to_dict(mcfg)},
                         tags={"scalelab.stage": "compress"}) as run:
            cm = compress(model, mcfg, calib_tokens=calib)
            loss = evaluate_loss(cm.model, val, seq_len, cfg.batch_size, max_tokens=cfg.eval_tokens)
            size = save_compressed(cm, Path(out_dir) / f"{setting}.safetensors")
            metrics = {"val_loss": loss, "ppl": math.exp(loss), "bytes_on_disk": size,
                       "base_val_loss": base_loss, "delta_val_loss": loss - base_loss}
            run.log_metrics(metrics)
            rows.append({k: v for k, v in params.items() if k != "stage"} | metrics)
            del cm
    return rows


@flow(name="compress", log_prints=True)
def compress_flow(
    root: str = ".",
    preset: str | None = None,
    workdir: str | None = None,
    runner: str | None = None,
    parent_run_id: str | None = None,
) -> list[dict]:
    ctx = stage_context(root, preset, workdir, runner, parent_run_id)
    cfg = ctx.config(CompressionConfig, "compression")
    with stage_run(ctx, "compress", cfg) as run, atomic_dir(ctx.layout.compressed) as out:
        models = trained_models(ctx, cfg.models)
        jobs = [
            dict(model_row=m | {"val_path": str(val_tokens_path(ctx)), "train_path": str(tokens_path(ctx, m))},
                 cfg=cfg, out_dir=str(out / m["variant"] / m["run"]), parent=run.ref())
            for m in models
        ]
        rows = [r for rs in map_tasks(ctx.pipeline, compress_model, jobs) for r in rs]
        write_table(ctx, "compress", rows, run)
        run.log_metrics({"models": len(models), "evaluations": len(rows)})
        print(f"compress: {len(rows)} (model, setting) pairs -> {ctx.layout.reports / 'compress.csv'}")
        return rows
