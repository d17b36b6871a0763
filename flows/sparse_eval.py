"""Stage 4, sparse_eval: every trained model (and pretrained models) under each training-free sparsity method and level.

Run: ``scalelab run sparse_eval [--preset ci]``. For each (model, setting, sparsity) the method's
patch is switched on, the validation split is scored and the achieved sparsity counted, and the
sparse path is timed against the dense one on the model's shapes (``speedup``,
:mod:`tasks.sparse.speed`). Models named in ``sparse_eval.pretrained`` (SmolLM2-135M) are scored on
the prepared validation text in their own tokenizer, and on a needle-retrieval set built from it
(``retrieval_acc``, :mod:`tasks.sparse.retrieval`). Writes ``reports/sparse_eval.csv`` (``model``
is the ladder run's name or ``smollm2-135m``; ``setting`` is ``<name>@<sparsity>``); one MLflow
run per point.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from flows.artifacts import publish_table, sparse_table
from flows.compress import PRETRAINED, prepared_text
from flows.evaluate_models import model_datasets, tokens_path, trained_models, val_tokens_path
from flows.stage import StageUnits, failures_path, mark_ok, stage_context, stage_run, write_table
from tasks.common.config import to_dict
from tasks.common.lineage import log_datasets
from tasks.common.parallel import set_process_threads
from tasks.common.tracking import RunRef, tracked_run
from tasks.lm.loss import evaluate_loss, perplexity
from tasks.sparse.registry import SparseEvalConfig, sparsify
from tasks.sparse.retrieval import RetrievalConfig, build_retrieval_set, retrieval_accuracy, score_retrieval
from tasks.sparse.speed import measured_speedup
from tasks.training.tokenizer import load_tokens
from tasks.zoo.ladder import load_model
from tasks.zoo.models import load_causal_lm


def run_points(*, model: Any, model_name: str, base_row: dict, settings: dict, val: np.ndarray,
               calib: np.ndarray | None, seq_len: int, batch_size: int, eval_tokens: int, parent: RunRef,
               data: tuple = (), speed: str = "all", items: list | None = None) -> list[dict]:
    """Every (setting, sparsity) of ``settings`` on one model: validation loss, achieved sparsity, the
    measured ``speedup`` of its sparse path (:mod:`tasks.sparse.speed`) and, given needle ``items``,
    ``retrieval_acc``; one MLflow run per point. ``base_row``: variant, run, n_params, tokens."""
    dense = evaluate_loss(model, val, seq_len, batch_size, max_tokens=eval_tokens)
    dense_acc = retrieval_accuracy(score_retrieval(model, items)) if items else None
    rows = []
    for setting, (method, mcfg) in settings.items():
        for sparsity in mcfg.sparsities:
            params = {"stage": "sparse_eval", "model": model_name, **base_row, "setting": f"{setting}@{sparsity:g}",
                      "method": method, "sparsity": sparsity}
            with tracked_run(f"sparse:{base_row['variant']}:{model_name}:{setting}@{sparsity:g}",
                             uri=parent.uri, experiment=parent.experiment, parent=parent,
                             params=params | {"config": to_dict(mcfg)}, tags={"scalelab.stage": "sparse_eval"}) as run:
                for ref, context in data:
                    log_datasets(run, [ref], context)
                handle = sparsify(model, mcfg, sparsity=sparsity, calib_tokens=calib)
                with handle:
                    loss = evaluate_loss(model, val, seq_len, batch_size, max_tokens=eval_tokens)
                metrics = {"val_loss": loss, "ppl": perplexity(loss), "achieved_sparsity": handle.achieved_sparsity(),
                           "dense_val_loss": dense, "delta_val_loss": loss - dense,
                           "speedup": measured_speedup(model, handle, sparsity, seq_len, speed),
                           "retrieval_acc": retrieval_accuracy(score_retrieval(model, items, handle)) if items else None,
                           "dense_retrieval_acc": dense_acc}
                run.log_metrics({k: v for k, v in metrics.items() if v is not None})
                rows.append({k: v for k, v in params.items() if k != "stage"} | metrics)
    return rows


@task(name="sparse-eval-model", cache_policy=NO_CACHE)
def sparse_eval_model(model_row: dict, cfg: SparseEvalConfig, parent: RunRef) -> list[dict]:
    set_process_threads(cfg.num_threads)
    model, meta = load_model(model_row["model_dir"])
    val = load_tokens(model_row["val_path"])
    calib = load_tokens(model_row["train_path"])[: cfg.calib_tokens] if cfg.calib_tokens else None
    base_row = {k: model_row[k] for k in ("variant", "run", "n_params", "tokens")}
    return run_points(model=model, model_name=model_row["run"], base_row=base_row, settings=cfg.methods(), val=val,
                      calib=calib, seq_len=cfg.seq_len or meta["seq_len"], batch_size=cfg.batch_size,
                      eval_tokens=cfg.eval_tokens, parent=parent, data=tuple(model_row.get("data") or ()),
                      speed=cfg.speed)


@task(name="sparse-eval-pretrained", cache_policy=NO_CACHE)
def sparse_eval_pretrained(name: str, cfg: SparseEvalConfig, prepared: str, parent: RunRef) -> list[dict]:
    """Every pretrained setting on one pretrained model (``smollm2``), on the prepared text; needle
    retrieval on items built from the validation text when ``retrieval`` is set."""
    import polars as pl

    set_process_threads(cfg.pretrained_num_threads)
    model, tok, meta = load_causal_lm(name)
    prepared_dir = Path(prepared)
    val, calib, data = prepared_text(prepared_dir, tok, cfg.pretrained_eval_tokens, cfg.calib_tokens)
    items = None
    if cfg.retrieval:
        rcfg = RetrievalConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in cfg.retrieval.items()})
        items = build_retrieval_set(tok, pl.read_parquet(prepared_dir / "val.parquet", columns=["text"])["text"].to_list(),
                                    rcfg)
    base_row = {"variant": "pretrained", "run": None, "n_params": meta.get("n_params"), "tokens": None}
    return run_points(model=model, model_name=PRETRAINED[name], base_row=base_row, settings=cfg.pretrained_methods(),
                      val=val, calib=calib, seq_len=cfg.pretrained_seq_len, batch_size=cfg.pretrained_batch_size,
                      # prepared_text gave eval_tokens + 1 tokens: eval_tokens predictions, whole windows of them
                      eval_tokens=len(val), parent=parent, speed=cfg.speed, items=items, data=data)


@flow(name="sparse_eval", log_prints=True)
def sparse_eval_flow(
    root: str = ".",
    preset: str | None = None,
    workdir: str | None = None,
    runner: str | None = None,
    parent_run_id: str | None = None,
) -> list[dict]:
    ctx = stage_context(root, preset, workdir, runner, parent_run_id)
    cfg = ctx.config(SparseEvalConfig, "sparse_eval")
    with stage_run(ctx, "sparse_eval", cfg) as run:
        models = trained_models(ctx, cfg.models, cfg.variants, key="sparse_eval.variants")
        data = model_datasets(ctx, models)
        jobs = [
            dict(model_row=m | {"val_path": str(val_tokens_path(ctx)), "train_path": str(tokens_path(ctx, m)),
                                "data": data[m["variant"]]},
                 cfg=cfg, parent=run.ref())
            for m in models
        ]
        units = StageUnits(ctx, run, "sparse_eval")
        results = units.map(sparse_eval_model, jobs, [f"{m['variant']}/{m['run']}" for m in models])
        # One at a time: a pretrained model is ~100x a ladder model, and its own threads use the cores.
        for name in cfg.pretrained:
            results.append(units.call(f"pretrained/{PRETRAINED[name]}", sparse_eval_pretrained.fn, name, cfg,
                                      str(ctx.layout.prepared), run.ref()))
        units.close()
        rows = [r for rs in results if rs is not None for r in mark_ok(rs)]
        # a failed unit keeps one row per (setting, sparsity), marked
        rows += [r for m in models for r in units.failed_rows(f"{m['variant']}/{m['run']}", [
            {"model": m["run"], **{k: m[k] for k in ("variant", "run", "n_params", "tokens")},
             "setting": f"{setting}@{sparsity:g}", "method": method, "sparsity": sparsity}
            for setting, (method, mcfg) in cfg.methods().items() for sparsity in mcfg.sparsities])]
        rows += [r for name in cfg.pretrained for r in units.failed_rows(f"pretrained/{PRETRAINED[name]}", [
            {"model": PRETRAINED[name], "variant": "pretrained", "setting": f"{setting}@{sparsity:g}", "method": method,
             "sparsity": sparsity} for setting, (method, mcfg) in cfg.pretrained_methods().items()
            for sparsity in mcfg.sparsities])]
        write_table(ctx, "sparse_eval", rows, run)
        publish_table(run, "sparse_eval", ctx.preset, sparse_table(rows), "Sparse inference: loss at each sparsity",
                      "`delta_val_loss` is the sparse model's validation loss minus the dense one's.")
        run.log_metrics({"models": len(models) + len(cfg.pretrained), "evaluations": len(rows)})
        print(f"sparse_eval: {len(rows)} points -> {ctx.layout.reports / 'sparse_eval.csv'}"
              + (f"; {len(units.failures)} unit(s) FAILED -> {failures_path(ctx.layout.reports, 'sparse_eval')}"
                 if units.failures else ""))
        return rows
