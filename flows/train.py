"""Stage 2, train: a ladder of LLaMA-style models (sizes x token budgets) on every curated variant.

Run: ``scalelab run train [--preset ci] [--runner ray]``. Trains the shared BPE tokenizer on the
raw training split, tokenizes each variant and the shared validation split, then trains every
(variant, size, tokens) point as its own task (a Ray task asking for a GPU under ``runner: ray``).
Writes ``models/trained/<variant>/<run>/``, ``reports/train.csv`` and ``reports/train_curves.csv``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
from pathlib import Path

import polars as pl
from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from flows.progress import progress_bars
from flows.runtime import Context, config_hash, map_tasks
from flows.stage import stage_context, stage_run, write_table
from tasks.common.io import read_json, write_json, write_text
from tasks.common.tracking import RunRef, tracked_run
from tasks.training.config import TrainingConfig
from tasks.training.loop import RunSpec, ladder, train_model
from tasks.training.repb import repb_arms
from tasks.training.tokenizer import encode_corpus, load_tokens, save_tokens, train_tokenizer


def file_digest(*paths: Path) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def curated_variants(curated: Path, wanted: tuple[str, ...]) -> list[str]:
    have = sorted(p.name for p in curated.iterdir() if (p / "kept.parquet").exists()) if curated.exists() else []
    if not have:
        raise FileNotFoundError(f"{curated}: no curated variants; run `scalelab run curate` first")
    missing = [v for v in wanted if v not in have]
    if missing:
        raise FileNotFoundError(f"training.variants names {missing[0]!r}, not among curated variants {have}")
    return list(wanted) if wanted else have


def ensure_tokenizer(ctx: Context, cfg: TrainingConfig):
    """Train the shared BPE on the raw training split once; retrain only when its inputs change."""
    from tokenizers import Tokenizer

    shards = sorted((ctx.layout.prepared / "train").glob("shard-*.parquet"))
    if not shards:
        raise FileNotFoundError(f"{ctx.layout.prepared / 'train'}: no prepared shards; run `scalelab run prepare` first")
    key = f"{file_digest(*shards)}-{cfg.vocab_size}"
    meta = ctx.layout.tokenizer.with_suffix(".meta.json")
    if ctx.layout.tokenizer.exists() and meta.exists() and read_json(meta).get("key") == key:
        return Tokenizer.from_file(str(ctx.layout.tokenizer))
    texts = pl.concat([pl.read_parquet(s, columns=["text"]) for s in shards])["text"]
    tok = train_tokenizer(texts, cfg.vocab_size)
    write_text(ctx.layout.tokenizer, tok.to_str())
    write_json(meta, {"key": key, "vocab_size": tok.get_vocab_size()})
    return tok


def ensure_tokens(tokenizer, source: Path, target: Path, tokenizer_path: Path) -> Path:
    """Tokenize ``source`` (a Parquet with ``text``) into ``target`` .npy, cached by content hash."""
    key = f"{file_digest(source)}-{file_digest(tokenizer_path)}"
    meta = target.with_suffix(".meta.json")
    if target.exists() and meta.exists() and read_json(meta).get("key") == key:
        return target
    texts = pl.read_parquet(source, columns=["text"])["text"]
    arr = encode_corpus(tokenizer, texts)
    save_tokens(target, arr)
    write_json(meta, {"key": key, "tokens": int(arr.size)})
    return target


@task(name="train-point", retries=0, cache_policy=NO_CACHE)
def train_point(
    variant: str, spec: RunSpec, cfg: TrainingConfig, train_path: str, val_path: str, out_dir: str,
    parent: RunRef, preset: str, data_variant: str | None = None, progress=None,
) -> dict:
    """Train one (variant, N, D) point in its own MLflow child run; returns its row for reports/train.csv.

    ``variant`` labels the series (``raw``, or ``raw+repb`` for the RePB arm); ``data_variant`` is
    the curated corpus it trained on (default: ``variant``).
    """
    params = {
        "stage": "train", "variant": variant, "data_variant": data_variant or variant, "preset": preset, "run": spec.name,
        "n_params": spec.n_params, "tokens": spec.tokens, "arch": cfg.arch,
        "data_pruning": "repb" if cfg.repb.enabled else "none",
        "d_model": spec.shape.d_model, "n_layers": spec.shape.n_layers, "n_heads": spec.shape.n_heads,
        "steps": spec.steps,
    }
    with tracked_run(f"train:{variant}:{spec.name}", uri=parent.uri, experiment=parent.experiment,
                     parent=parent, params=params, tags={"scalelab.stage": "train"}) as run:
        result = train_model(
            spec, cfg, load_tokens(train_path), load_tokens(val_path), Path(out_dir),
            on_metrics=lambda m, step: run.log_metrics(m, step=step), progress=progress,
        )
        row = dataclasses.asdict(result)
        history = row.pop("history", [])
        final = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        run.log_metrics(final | {"flops": (row.get("flops_6nd") or 0) + (row.get("flops_attn") or 0)})
        return {"variant": variant, "run": spec.name, **params, **final, "history": history}


def run_ladder(ctx: Context, cfg: TrainingConfig, jobs: list[dict], parent: RunRef) -> list[dict]:
    """Fan the ladder's points out through the context's task runner (progress bars when local)."""
    local = ctx.pipeline.runner == "local"
    with progress_bars(enabled=local) as bars:
        jobs = [
            dict({"cfg": cfg} | job, parent=parent, preset=ctx.preset,
                 progress=bars.bar(f"{job['variant']}/{job['spec'].name}", job["spec"].steps) if local else None)
            for job in jobs
        ]
        return map_tasks(ctx.pipeline, train_point, jobs)


@flow(name="train", log_prints=True)
def train_flow(
    root: str = ".",
    preset: str | None = None,
    workdir: str | None = None,
    runner: str | None = None,
    parent_run_id: str | None = None,
) -> list[dict]:
    ctx = stage_context(root, preset, workdir, runner, parent_run_id)
    cfg = ctx.config(TrainingConfig, "training")
    layout = ctx.layout
    with stage_run(ctx, "train", cfg) as run:
        tokenizer = ensure_tokenizer(ctx, cfg)
        val_path = ensure_tokens(tokenizer, layout.prepared / "val.parquet", layout.tokens / "val.npy", layout.tokenizer)
        variants = curated_variants(layout.curated, cfg.variants)
        not_trained = [v for v in cfg.repb.compare if v not in variants]
        if not_trained:
            raise ValueError(f"training.repb.compare names {not_trained[0]!r}, not among the trained variants {variants}")
        specs = ladder(cfg)
        jobs, keep_dirs = [], set()
        for variant in variants:
            train_path = ensure_tokens(tokenizer, layout.curated / variant / "kept.parquet",
                                       layout.tokens / f"{variant}.npy", layout.tokenizer)
            digest = file_digest(train_path, val_path)
            # A variant in training.repb.compare also trains pruned, reported as <variant>+repb.
            for suffix, arm_cfg in repb_arms(cfg, variant):
                label = variant + suffix
                for spec in specs:
                    # Keyed by what made it, so a changed config or corpus never reuses a stale result.
                    out_dir = layout.trained / label / f"{spec.name}-{config_hash(arm_cfg, spec, digest)}"
                    keep_dirs.add(out_dir)
                    jobs.append(dict(variant=label, data_variant=variant, spec=spec, cfg=arm_cfg, train_path=str(train_path),
                                     val_path=str(val_path), out_dir=str(out_dir)))
        rows = run_ladder(ctx, cfg, jobs, run.ref())
        for variant_dir in layout.trained.iterdir():
            for d in variant_dir.iterdir() if variant_dir.is_dir() else []:
                if d.is_dir() and d not in keep_dirs:
                    shutil.rmtree(d)  # outputs of an older config: not part of this ladder
        curves = [
            {"variant": r["variant"], "run": r["run"], "n_params": r["n_params"], "step": h[0], "train_loss": h[1], "val_loss": h[2]}
            for r in rows for h in r["history"]
        ]
        # Model folders relative to the workdir, so the table stays valid in a moved copy (dvc exp --temp).
        for r, job in zip(rows, jobs):
            r["model_dir"] = str(Path(job["out_dir"]).relative_to(ctx.workdir))
        table = [{k: v for k, v in r.items() if k not in ("history", "stage", "preset")} for r in rows]
        write_table(ctx, "train", table, run)
        write_table(ctx, "train_curves", curves, run)
        run.log_metrics({"runs": len(rows)})
        print(f"train: {len(rows)} runs over {len(variants)} variants -> {layout.reports / 'train.csv'}")
        return table
