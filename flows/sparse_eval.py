"""Stage 4, sparse_eval: every trained model under each training-free sparsity method and level.

Run: ``scalelab run sparse_eval [--preset ci]``. For each (model, setting, sparsity) the method's
hooks are switched on, the shared validation split is scored and the achieved sparsity counted.
Writes ``reports/sparse_eval.csv`` (``setting`` is ``<name>@<sparsity>``); one MLflow run per point.
"""

from __future__ import annotations

import math

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from flows.artifacts import publish_table, sparse_table
from flows.evaluate_models import model_datasets, tokens_path, trained_models, val_tokens_path
from flows.runtime import map_tasks
from flows.stage import stage_context, stage_run, write_table
from tasks.common.config import to_dict
from tasks.common.lineage import log_datasets
from tasks.common.tracking import RunRef, tracked_run
from tasks.evaluation.loss import evaluate_loss
from tasks.sparse.registry import SparseEvalConfig, sparsify
from tasks.training.loop import load_model, set_process_threads
from tasks.training.tokenizer import load_tokens


@task(name="sparse-eval-model", cache_policy=NO_CACHE)
def sparse_eval_model(model_row: dict, cfg: SparseEvalConfig, parent: RunRef) -> list[dict]:
    set_process_threads(cfg.num_threads)
    model, meta = load_model(model_row["model_dir"])
    seq_len = cfg.seq_len or meta["seq_len"]
    val = load_tokens(model_row["val_path"])
    calib = load_tokens(model_row["train_path"])[: cfg.calib_tokens] if cfg.calib_tokens else None
    dense = evaluate_loss(model, val, seq_len, cfg.batch_size, max_tokens=cfg.eval_tokens)
    rows = []
    for setting, (method, mcfg) in cfg.methods().items():
        for sparsity in mcfg.sparsities:
            params = {
                "stage": "sparse_eval", "variant": model_row["variant"], "run": model_row["run"],
                "setting": f"{setting}@{sparsity:g}", "method": method, "sparsity": sparsity,
                "n_params": model_row["n_params"], "tokens": model_row["tokens"],
            }
            with tracked_run(f"sparse:{model_row['variant']}:{model_row['run']}:{setting}@{sparsity:g}",
                             uri=parent.uri, experiment=parent.experiment, parent=parent,
                             params=params | {"config": to_dict(mcfg)}, tags={"scalelab.stage": "sparse_eval"}) as run:
                for ref, context in model_row.get("data") or ():
                    log_datasets(run, [ref], context)
                with sparsify(model, mcfg, sparsity=sparsity, calib_tokens=calib) as handle:
                    loss = evaluate_loss(model, val, seq_len, cfg.batch_size, max_tokens=cfg.eval_tokens)
                metrics = {"val_loss": loss, "ppl": math.exp(loss), "achieved_sparsity": handle.achieved_sparsity(),
                           "dense_val_loss": dense, "delta_val_loss": loss - dense}
                run.log_metrics(metrics)
                rows.append({k: v for k, v in params.items() if k != "stage"} | metrics)
    return rows


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
        models = trained_models(ctx, cfg.models)
        data = model_datasets(ctx, models)
        jobs = [
            dict(model_row=m | {"val_path": str(val_tokens_path(ctx)), "train_path": str(tokens_path(ctx, m)),
                                "data": data[m["variant"]]},
                 cfg=cfg, parent=run.ref())
            for m in models
        ]
        rows = [r for rs in map_tasks(ctx.pipeline, sparse_eval_model, jobs) for r in rs]
        write_table(ctx, "sparse_eval", rows, run)
        publish_table(run, "sparse_eval", ctx.preset, sparse_table(rows), "Sparse inference: loss at each sparsity",
                      "`delta_val_loss` is the sparse model's validation loss minus the dense one's.")
        run.log_metrics({"models": len(models), "evaluations": len(rows)})
        print(f"sparse_eval: {len(rows)} points -> {ctx.layout.reports / 'sparse_eval.csv'}")
        return rows
