"""Stage 3, compress: every enabled compression setting on every trained model (and on pretrained models).

Run: ``scalelab run compress [--preset ci]``. For each (model, setting): compress, score the
shared validation split, and write the packed model to ``models/compressed/<variant>/<run>/<setting>.safetensors``
(``bytes_on_disk`` is that file's size). A multi-precision artifact (AnyBCQ) is stored once and
scored at every precision it serves, one row each (setting ``<name>@w<bits>``). Pretrained models
named in ``compression.pretrained`` (SmolLM2-135M) are calibrated on the prepared training text and
scored on the prepared validation text, both tokenized with their own tokenizer, and written to
``models/compressed/pretrained/<model>/``. Writes ``reports/compress.csv`` (``model``, ``method``,
``bits``, ``bits_per_weight``, ``ppl``, ``ppl_fp``, ...); one MLflow run per (model, setting).
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from torch import nn

from flows.artifacts import compress_table, publish_table
from flows.evaluate_models import model_datasets, tokens_path, trained_models, val_tokens_path
from flows.stage import StageUnits, failures_path, mark_ok, stage_context, stage_run, write_table
from tasks.common.config import to_dict
from tasks.common.io import atomic_dir
from tasks.common.lineage import DataRef, data_ref, log_datasets, log_model_ref
from tasks.common.parallel import set_process_threads
from tasks.common.registry import MethodSpec
from tasks.common.tracking import RunRef, tracked_run
from tasks.compression.config import CompressionConfig
from tasks.compression.registry import compress
from tasks.lm.loss import evaluate_loss, perplexity
from tasks.lm.model import resolve_llama_classes
from tasks.training.tokenizer import load_tokens
from tasks.zoo.compressed import CompressedModel, model_from_tensors, save_compressed
from tasks.zoo.ladder import load_model
from tasks.zoo.models import load_causal_lm

# Pretrained models the stage can include, by params name -> the name its rows carry.
PRETRAINED = {"smollm2": "smollm2-135m"}


def calib_eval_overlap(calib: np.ndarray | None, val: np.ndarray, n: int = 32) -> float:
    """Share of the evaluation stream's ``n``-token windows (stride ``n``) found verbatim in the calibration tokens.

    0.0 when calibration and evaluation are disjoint texts; 1.0 when calibrating on the eval set.
    """
    if calib is None or len(calib) < n or len(val) < n:
        return 0.0
    from numpy.lib.stride_tricks import sliding_window_view

    c = np.ascontiguousarray(sliding_window_view(np.asarray(calib, dtype=np.int64), n))
    seen = {row.tobytes() for row in c}
    v = np.asarray(val[: (len(val) // n) * n], dtype=np.int64).reshape(-1, n)
    return float(np.mean([row.tobytes() in seen for row in v]))


def check_overlap(share: float, what: str, limit: float = 0.01) -> None:
    """Refuse calibration text that overlaps the evaluation text (ppl would be flattered); warn on any overlap."""
    if share > limit:
        raise ValueError(f"{what}: {share:.1%} of the evaluation windows occur verbatim in the calibration tokens "
                         f"(limit {limit:.0%}); calibrate on the training split, not the evaluation text")
    if share > 0:
        warnings.warn(f"{what}: {share:.2%} of the evaluation windows also occur in the calibration tokens",
                      RuntimeWarning, stacklevel=2)


def precision_models(cm: CompressedModel, base: nn.Module) -> list[tuple[int | float | None, float | None, nn.Module]]:
    """``(bits, bits_per_weight, model)`` for every precision the artifact serves (one unless multi-precision)."""
    precisions = cm.meta.get("precisions")
    if not precisions:
        cfg = cm.meta.get("config") or {}
        bits = cfg.get("budget_bits") or cfg.get("bits")
        return [(bits, cm.meta.get("bits_per_weight"), cm.model)]
    out = []
    for k, bpw in sorted(precisions.items(), key=lambda kv: int(kv[0])):
        k = int(k)
        model = cm.model if k == cm.meta.get("bits") else model_from_tensors(cm.tensors, cm.meta, base, bits=k)
        out.append((k, bpw, model))
    return out


def run_settings(
    *, model: nn.Module, model_name: str, base_row: dict[str, Any], settings: dict[str, tuple[str, MethodSpec]],
    val: np.ndarray, calib: np.ndarray | None, seq_len: int, batch_size: int, eval_tokens: int, out_dir: Path,
    parent: RunRef, data: tuple[tuple[DataRef, str], ...] = (), base: dict[str, str] | None = None,
    final_dir: Path | None = None,
) -> list[dict]:
    """Every setting on one model: compress, save, score each served precision; one MLflow child run per setting.

    ``data``: (dataset, context) pairs logged on each run (``evaluation``'s scores the metrics). With ``base`` (the pyfunc's
    ``base_dir`` or ``base``) every scored precision is logged as an MLflow model pointing at its file
    in ``final_dir`` (where ``out_dir``'s files live once the stage ends)."""
    overlap = calib_eval_overlap(calib, val[:eval_tokens])
    check_overlap(overlap, model_name)
    base_loss = evaluate_loss(model, val, seq_len, batch_size, max_tokens=eval_tokens)
    rows = []
    for setting, (method, mcfg) in settings.items():
        params = base_row | {
            "model": model_name, "setting": setting, "method": method,
            "bits": getattr(mcfg, "bits", None), "group_size": getattr(mcfg, "group_size", None),
            "calib_tokens": 0 if calib is None else int(len(calib)),
        }
        with tracked_run(f"compress:{model_name}:{setting}", uri=parent.uri, experiment=parent.experiment,
                         parent=parent, params=params | {"stage": "compress", "config": to_dict(mcfg)},
                         tags={"scalelab.stage": "compress"}) as run:
            for ref, context in data:
                log_datasets(run, [ref], context)
            cm = compress(model, mcfg, calib_tokens=calib)
            size = save_compressed(cm, out_dir / f"{setting}.safetensors")
            multi = bool(cm.meta.get("precisions"))
            for bits, bpw, qmodel in precision_models(cm, model):
                loss = evaluate_loss(qmodel, val, seq_len, batch_size, max_tokens=eval_tokens)
                suffix = f"@w{bits}" if multi else ""  # the row's setting; MLflow metric names get _w<bits>
                metrics = {"val_loss": loss, "ppl": perplexity(loss), "ppl_fp": perplexity(base_loss),
                           "bits_per_weight": bpw, "bytes_on_disk": size, "base_val_loss": base_loss,
                           "delta_val_loss": loss - base_loss, "calib_eval_overlap": overlap}
                run.log_metrics({f"{k}_w{bits}" if multi else k: v for k, v in metrics.items() if v is not None})
                if base is not None:
                    file = (final_dir or out_dir) / f"{setting}.safetensors"
                    log_model_ref(run, f"{base_row['variant']}-{model_name}-{setting}{suffix}",
                                  {"kind": "compressed", "file": str(file.resolve()), **base, "bits": bits,
                                   "multi_precision": multi},
                                  key=f"{base_row['variant']}/{model_name}/{setting}{suffix}",
                                  model_type="scalelab-compressed", params=params | {"bits": bits},
                                  metrics={k: metrics[k] for k in ("val_loss", "ppl", "bits_per_weight", "bytes_on_disk")},
                                  dataset=next((r for r, c in data if c == "evaluation"), None))
                rows.append(params | {"setting": setting + suffix, "bits": bits} | metrics)
            del cm
    return rows


def compress_model(model_row: dict, cfg: CompressionConfig, out_dir: str, parent: RunRef,
                   final_dir: str | None = None) -> list[dict]:
    """Every enabled setting on one trained model (``model_row["data"]``: its datasets, when given)."""
    set_process_threads(cfg.num_threads)
    model, meta = load_model(model_row["model_dir"])
    seq_len = cfg.seq_len or meta["seq_len"]
    val = load_tokens(model_row["val_path"])
    calib = load_tokens(model_row["train_path"])[: cfg.calib_tokens] if cfg.calib_tokens else None
    base_row = {"variant": model_row["variant"], "run": model_row["run"], "n_params": model_row["n_params"],
                "tokens": model_row["tokens"]}
    return run_settings(model=model, model_name=model_row["run"], base_row=base_row, settings=cfg.methods(),
                        val=val, calib=calib, seq_len=seq_len, batch_size=cfg.batch_size,
                        eval_tokens=cfg.eval_tokens, out_dir=Path(out_dir), parent=parent,
                        data=tuple(model_row.get("data") or ()), base={"base_dir": str(Path(model_row["model_dir"]).resolve())},
                        final_dir=Path(final_dir) if final_dir else None)


def text_tokens(paths: list[Path], tokenizer: Any, max_tokens: int, eos: int | None) -> np.ndarray:
    """The first ``max_tokens`` tokens of the ``text`` column of ``paths`` (Parquet), documents joined by ``eos``."""
    import polars as pl

    out: list[int] = []
    for path in paths:
        texts = pl.read_parquet(path, columns=["text"])["text"].to_list()
        for start in range(0, len(texts), 64):
            for ids in tokenizer.encode_batch(texts[start : start + 64], add_special_tokens=False):
                out.extend(ids)
                if eos is not None:
                    out.append(eos)
            if len(out) >= max_tokens:
                return np.asarray(out[:max_tokens], dtype=np.int64)
    return np.asarray(out, dtype=np.int64)


def prepared_text(prepared_dir: Path, tokenizer: Any, eval_tokens: int, train_tokens: int
                  ) -> tuple[np.ndarray, np.ndarray | None, tuple]:
    """A pretrained model's text from the prepared corpus, in its own tokenizer: the first
    ``eval_tokens + 1`` validation tokens, the first ``train_tokens`` training tokens (None for 0),
    and the two datasets as ``(DataRef, context)`` pairs for MLflow."""
    shards = sorted((prepared_dir / "train").glob("*.parquet"))
    if not shards:
        raise FileNotFoundError(f"{prepared_dir / 'train'}: no prepared training text; run `scalelab run prepare` first")
    eos = tokenizer.eos_token_id
    val = text_tokens([prepared_dir / "val.parquet"], tokenizer, eval_tokens + 1, eos)
    train = text_tokens(shards, tokenizer, train_tokens, eos) if train_tokens else None
    data = ((data_ref(prepared_dir.parents[1], prepared_dir / "train", "prepared-train"), "calibration"),
            (data_ref(prepared_dir.parents[1], prepared_dir / "val.parquet", "val"), "evaluation"))
    return val, train, data


def compress_pretrained(name: str, cfg: CompressionConfig, prepared: str, out_dir: str, parent: RunRef,
                        final_dir: str | None = None, settings: tuple[str, ...] = ()) -> list[dict]:
    """The pretrained settings (``settings`` of them; empty = every one) on one pretrained model
    (``smollm2``), on the prepared train/val text."""
    set_process_threads(cfg.num_threads)
    model, tok, meta = load_causal_lm(name)
    val, calib, data = prepared_text(Path(prepared), tok, cfg.pretrained_eval_tokens, cfg.pretrained_calib_tokens)
    base_row = {"variant": "pretrained", "run": None, "n_params": meta.get("n_params"), "tokens": None}
    methods = cfg.pretrained_methods()
    methods = {k: methods[k] for k in settings} if settings else methods
    return run_settings(model=model, model_name=PRETRAINED[name], base_row=base_row, settings=methods,
                        val=val, calib=calib, seq_len=cfg.pretrained_seq_len, batch_size=cfg.pretrained_batch_size,
                        eval_tokens=cfg.pretrained_eval_tokens, out_dir=Path(out_dir), parent=parent,
                        data=data, base={"base": name}, final_dir=Path(final_dir) if final_dir else None)


@task(name="compress-model", cache_policy=NO_CACHE)
def compress_job(kind: str, job: dict) -> list[dict]:
    """One unit of the stage's work: ``ladder`` (a trained model) or ``pretrained`` (SmolLM2)."""
    fn = {"ladder": compress_model, "pretrained": compress_pretrained}[kind]
    return fn(**job)


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
        models = trained_models(ctx, cfg.models, cfg.variants, key="compression.variants")
        data = model_datasets(ctx, models)
        # Pretrained models first, one job per setting (each ~100x a ladder model; the model loads from
        # its cache after the first job, tasks.zoo.models), the ladder's short jobs after them.
        jobs = [
            dict(kind="pretrained", job=dict(name=name, cfg=cfg, prepared=str(ctx.layout.prepared),
                                             out_dir=str(out / "pretrained" / PRETRAINED[name]), parent=run.ref(),
                                             final_dir=str(ctx.layout.compressed / "pretrained" / PRETRAINED[name]),
                                             settings=(setting,)))
            for name in cfg.pretrained for setting in cfg.pretrained_methods()
        ]
        n_pre = len(jobs)
        jobs += [
            dict(kind="ladder", job=dict(
                model_row=m | {"val_path": str(val_tokens_path(ctx)), "train_path": str(tokens_path(ctx, m)),
                               "data": data[m["variant"]]},
                cfg=cfg, out_dir=str(out / m["variant"] / m["run"]), parent=run.ref(),
                final_dir=str(ctx.layout.compressed / m["variant"] / m["run"])))
            for m in models
        ]
        if cfg.pretrained:
            resolve_llama_classes()
        names = [f"pretrained/{PRETRAINED[name]}:{setting}" for name in cfg.pretrained
                 for setting in cfg.pretrained_methods()] + [f"{m['variant']}/{m['run']}" for m in models]
        units = StageUnits(ctx, run, "compress")
        results = units.map(compress_job, jobs, names)
        for job, name in zip(jobs, names):  # what a failed unit half-wrote is not published
            if units.failed(name):
                shutil.rmtree(job["job"]["out_dir"], ignore_errors=True)
        units.close()
        # the ladder's rows first, as before; a failed unit keeps one row per setting, marked
        rows = [r for res in results[n_pre:] + results[:n_pre] if res is not None for r in mark_ok(res)]
        rows += [r for m in models for r in units.failed_rows(
            f"{m['variant']}/{m['run']}",
            [{"variant": m["variant"], "run": m["run"], "n_params": m["n_params"], "tokens": m["tokens"],
              "model": m["run"], "setting": setting, "method": method} for setting, (method, _) in cfg.methods().items()])]
        rows += [r for name in cfg.pretrained for setting, (method, _) in cfg.pretrained_methods().items()
                 for r in units.failed_rows(f"pretrained/{PRETRAINED[name]}:{setting}",
                                            [{"variant": "pretrained", "model": PRETRAINED[name], "setting": setting,
                                              "method": method}])]
        write_table(ctx, "compress", rows, run)
        publish_table(run, "compress", ctx.preset, compress_table(rows), "Compression: loss at measured bits per weight",
                      "`delta_val_loss` is the compressed model's validation loss minus the uncompressed one's.")
        run.log_metrics({"models": len(models) + len(cfg.pretrained), "evaluations": len(rows)})
        print(f"compress: {len(rows)} (model, setting) evaluations -> {ctx.layout.reports / 'compress.csv'}"
              + (f"; {len(units.failures)} unit(s) FAILED -> {failures_path(ctx.layout.reports, 'compress')}"
                 if units.failures else ""))
        return rows
