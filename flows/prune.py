"""Stage 3b, prune: structured pruning and distillation-based recovery on the ladder and on pretrained models.

Run: ``scalelab run prune [--preset ci]``. For each model (by default the largest trained run of
each variant, and SmolLM2-135M when ``pruning.pretrained`` names it) and each enabled setting of
params/pruning.yaml: prune a copy with the setting's method (EntroDrop, cosine_drop, ...), score it
on the validation split, then recover it by distillation from the unpruned model with every loss of
``pruning.recovery.losses`` (CSD, forward KL, DLD) on the same training windows and score each; the
windows are a ``budget`` share of the candidates chosen at random or by PASER (``data_select``).
Writes ``reports/pruning.csv`` (model, variant, method, removed_fraction, recovery_loss, data_select,
recovery_tokens, ppl, params, flops_per_token, ...); one MLflow run per (model, row).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from tokenizers import Tokenizer

from flows.compress import PRETRAINED, check_overlap, calib_eval_overlap, text_tokens
from flows.evaluate_models import tokens_path, trained_models, val_tokens_path
from flows.runtime import map_tasks
from flows.stage import stage_context, stage_run, write_table
from tasks.common.tracking import RunRef, tracked_run
from tasks.compression.pruning import PruningConfig, RecoveryConfig, largest_per_variant, prune_rows
from tasks.training.loop import load_model, set_process_threads
from tasks.training.tokenizer import load_tokens


def _logger(parent: RunRef, model_name: str):
    """``log(setting, params, metrics)``: one MLflow child run per row of the table."""

    def log(setting: str, params: dict[str, Any], metrics: dict[str, Any]) -> None:
        with tracked_run(f"prune:{model_name}:{setting}", uri=parent.uri, experiment=parent.experiment, parent=parent,
                         params=params | {"stage": "prune", "model": model_name, "setting": setting},
                         tags={"scalelab.stage": "prune"}) as run:
            run.log_metrics({k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})

    return log


def split_train(train: np.ndarray, calib_tokens: int, recovery: RecoveryConfig, what: str) -> tuple[np.ndarray, np.ndarray]:
    """``(calibration, recovery)`` tokens: the first ``calib_tokens`` and the ``recovery.tokens`` after them."""
    need = calib_tokens + recovery.seq_len
    if len(train) < need:
        raise ValueError(f"{what}: {len(train)} training tokens, need at least {need} "
                         f"(pruning.calib_tokens {calib_tokens} + recovery.seq_len {recovery.seq_len})")
    return train[:calib_tokens], train[calib_tokens : calib_tokens + recovery.tokens]


@task(name="prune-model", cache_policy=NO_CACHE)
def prune_model(model_row: dict, cfg: PruningConfig, parent: RunRef) -> list[dict]:
    """Every enabled setting on one trained model."""
    set_process_threads(cfg.num_threads)
    model, meta = load_model(model_row["model_dir"])
    seq_len = cfg.seq_len or meta["seq_len"]
    val = load_tokens(model_row["val_path"])
    calib, train = split_train(load_tokens(model_row["train_path"]), cfg.calib_tokens, cfg.recovery, model_row["train_path"])
    check_overlap(calib_eval_overlap(calib, val[: cfg.eval_tokens]), model_row["run"])
    base_row = {"model": model_row["run"], "variant": model_row["variant"], "run": model_row["run"]}
    tokenizer = Tokenizer.from_file(model_row["tokenizer_path"])
    return prune_rows(model, settings=cfg.methods(), recovery=cfg.recovery, calib=calib, train=train, val=val,
                      seq_len=seq_len, batch_size=cfg.batch_size, eval_tokens=cfg.eval_tokens, base_row=base_row,
                      log=_logger(parent, model_row["run"]), texts=lambda w: tokenizer.decode_batch(w.tolist()))


def prune_pretrained(name: str, cfg: PruningConfig, prepared: str, parent: RunRef) -> list[dict]:
    """Every pretrained setting on one pretrained model, on the prepared train/val text in its own tokenizer."""
    from tasks.common.models import load_causal_lm

    set_process_threads(cfg.pretrained_num_threads)
    model, tok, _ = load_causal_lm(name)
    recovery = cfg.pretrained_recovery or cfg.recovery
    prepared_dir = Path(prepared)
    shards = sorted((prepared_dir / "train").glob("*.parquet"))
    if not shards:
        raise FileNotFoundError(f"{prepared_dir / 'train'}: no prepared training text; run `scalelab run prepare` first")
    val = text_tokens([prepared_dir / "val.parquet"], tok, cfg.pretrained_eval_tokens + 1, tok.eos_token_id)
    train = text_tokens(shards, tok, cfg.pretrained_calib_tokens + recovery.tokens, tok.eos_token_id)
    calib, rec = split_train(train, cfg.pretrained_calib_tokens, recovery, f"{prepared_dir / 'train'} ({name})")
    base_row = {"model": PRETRAINED[name], "variant": "pretrained", "run": None}
    return prune_rows(model, settings=cfg.methods(pretrained=True), recovery=recovery, calib=calib, train=rec,
                      val=val, seq_len=cfg.pretrained_seq_len, batch_size=cfg.pretrained_batch_size,
                      eval_tokens=cfg.pretrained_eval_tokens, base_row=base_row, log=_logger(parent, PRETRAINED[name]),
                      texts=lambda w: tok.decode_batch(w.tolist()))


@flow(name="prune", log_prints=True)
def prune_flow(
    root: str = ".",
    preset: str | None = None,
    workdir: str | None = None,
    runner: str | None = None,
    parent_run_id: str | None = None,
) -> list[dict]:
    ctx = stage_context(root, preset, workdir, runner, parent_run_id)
    cfg = ctx.config(PruningConfig, "pruning")
    with stage_run(ctx, "prune", cfg) as run:
        models = trained_models(ctx, cfg.models)
        if not cfg.models and cfg.largest_only:
            models = largest_per_variant(models)
        jobs = [dict(model_row=m | {"val_path": str(val_tokens_path(ctx)), "train_path": str(tokens_path(ctx, m)),
                                    "tokenizer_path": str(ctx.layout.tokenizer)},
                     cfg=cfg, parent=run.ref()) for m in models]
        rows = [r for rs in map_tasks(ctx.pipeline, prune_model, jobs) for r in rs]
        for name in cfg.pretrained:  # one at a time: its own threads use the cores
            rows += prune_pretrained(name, cfg, str(ctx.layout.prepared), run.ref())
        write_table(ctx, "pruning", rows, run)
        run.log_metrics({"models": len(models) + len(cfg.pretrained), "rows": len(rows)})
        print(f"prune: {len(rows)} rows -> {ctx.layout.reports / 'pruning.csv'}")
        return rows
