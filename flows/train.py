"""Stage 2, train: a ladder of LLaMA-style models (sizes x token budgets) on every curated variant.

Run: ``scalelab run train [--preset ci] [--runner ray]``. Trains the shared BPE tokenizer on the
raw training split, tokenizes each variant and the shared validation split, then trains every
(variant, size, tokens) point as its own task (a Ray task asking for a GPU under ``runner: ray``).
Under ``schedule: wsd`` each (variant, size) is one task: a stable run and a cooldown branch per
budget. Writes ``models/trained/<variant>/<run>/``, ``reports/train.csv`` (N counted both ways,
``flops_total``, ``epochs``, ``unique_tokens``, ``diverged``, ``point``), ``reports/train_curves.csv`` and
``reports/val_by_source.csv`` (each run's loss per corpus source, over every validation token) and
``reports/val_docs.parquet`` (each run's summed loss per validation document, for paired
per-document comparisons of variants). A run's ``val_loss`` is its mean over the whole validation
split (``val_tokens`` scored targets); ``train_curves.csv`` stays on the first ``eval_tokens``.

``training.seeds`` retrains the sizes of ``seed_sizes`` with each extra seed (same series label, its
own folders); those runs go to ``reports/train_seeds.csv`` (train.csv's columns) and, with their
``seed``, to ``val_docs.parquet``, never to train.csv (``seed`` column: the base seed), so every
later stage still reads one run per ladder point and registers base-seed models only.

train.csv's ``point`` is ``ladder`` for a point of the design and ``anneal`` for an extra cooldown
branch of ``training.extra_branches`` (no ``compute_budget``): the fit stage's laws use both, the
per-budget "best run" comparisons and registered ``best-<budget>`` models only ladder points, and
the stages that pick trained models (``flows/evaluate_models.trained_models``) skip anneal points.
``training.arch_compare`` adds the series ``<variant>+xlstm`` (or ``+llama``) on the same points.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import shutil
from pathlib import Path

import numpy as np
import polars as pl
from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from flows.feasibility import checked_ladder
from flows.progress import progress_bars
from flows.artifacts import publish_table, train_table
from flows.runtime import Context, config_hash, map_tasks
from flows.stage import FAILED, OK, STATUS, StageUnits, mark_ok, stage_context, stage_run, write_table
from tasks.common.io import atomic_path, read_json, write_json, write_text
from tasks.common.config import to_dict
from tasks.common.lineage import DataRef, budget_label, data_ref, log_datasets, log_model_ref, register_alias
from tasks.common.parallel import set_process_threads
from tasks.common.tracking import RunRef, tracked_run
from tasks.training.config import TrainingConfig
from tasks.training.arms import training_arms
from tasks.training.design import arch_specs, seed_sizes
from tasks.training.distributed import PointJob, check_parallel, train_points
from tasks.training.loop import read_doc_losses
from tasks.training.design import RunSpec, ladder
from tasks.training.tokenizer import encode_corpus, encode_corpus_segments, load_tokens, save_tokens, train_tokenizer


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


def ensure_val_tokens(tokenizer, source: Path, target: Path, tokenizer_path: Path) -> tuple[Path, Path, Path]:
    """Tokenize the validation split into ``target``, the source of each token into
    ``<target>.sources.npy`` (int16 codes; names in the meta) and the document of each token into
    ``<target>.docs.npy`` (int32 row of ``source``), cached by content hash. Returns the three paths."""
    groups = target.with_suffix(".sources.npy")
    docs = target.with_suffix(".docs.npy")
    key = f"{file_digest(source)}-{file_digest(tokenizer_path)}-sources-docs"
    meta = target.with_suffix(".meta.json")
    if all(p.exists() for p in (target, groups, docs, meta)) and read_json(meta).get("key") == key:
        return target, groups, docs
    frame = pl.read_parquet(source, columns=["text", "source"])
    arr, doc_index = encode_corpus_segments(tokenizer, frame["text"])
    names = sorted(set(frame["source"].to_list()))
    codes = np.array([names.index(x) for x in frame["source"].to_list()], dtype=np.int16)
    save_tokens(target, arr)
    save_tokens(groups, codes[doc_index])
    save_tokens(docs, doc_index.astype(np.int32))
    write_json(meta, {"key": key, "tokens": int(arr.size), "documents": frame.height, "sources": names})
    return target, groups, docs


def source_labels(groups_path: Path) -> np.ndarray:
    """The source name of every validation token (from ``ensure_val_tokens``' codes)."""
    names = np.array(read_json(Path(groups_path).with_name(Path(groups_path).name.replace(".sources.npy", ".meta.json")))["sources"])
    return names[load_tokens(groups_path, mmap=False).astype(np.int64)]


OWNER_FILE = "owner.json"


def folder_key(cfg: TrainingConfig) -> dict:
    """The config a model folder is keyed by: ``cfg`` less the lists of extra seeds, extra branches
    and arch arms and the feasibility settings (which points train, not what one is), so adding or
    removing one leaves every other run's folder (and the base runs of older ladders) in place. An
    extra-seed arm's ``seed`` differs, an arch arm's ``arch``, which gives each folders of its own. How
    many workers train a point (``workers_per_point``, ``gpus_per_worker``, ``parallel``) is left out
    too: the point is the same at any W, and a run interrupted at one W resumes at another."""
    return {k: v for k, v in to_dict(cfg).items()
            if k not in ("seeds", "seed_sizes", "extra_branches", "arch_compare", "feasibility",
                         "workers_per_point", "gpus_per_worker", "parallel")}


@task(name="train-size", retries=0, cache_policy=NO_CACHE)
def train_size(
    variant: str, specs: list[RunSpec], cfg: TrainingConfig, train_path: str, val_path: str, val_groups_path: str,
    out_dirs: list[str], stable_dir: str | None, parent: RunRef, preset: str, data_variant: str | None = None,
    progress=None, data: tuple[DataRef, DataRef] | None = None, val_docs_path: str | None = None,
    extra_seed: bool = False, launcher: str = "local",
) -> list[dict]:
    """Train one size's points of one series (every budget under WSD, one point under cosine), each in its
    own MLflow child run; returns their rows for reports/train.csv.

    ``variant`` labels the series (``raw``, or ``raw+repb`` for the RePB arm); ``data_variant`` is
    the curated corpus it trained on (default: ``variant``). ``data``: the (training, validation)
    token files as MLflow datasets, logged on every run; each trained model is logged as an MLflow
    model (by reference) with its metrics, its id in the row's ``model_id``. ``val_docs_path``: each
    validation token's document (``ensure_val_tokens``), so every run writes ``doc_losses.parquet``.
    ``extra_seed``: ``cfg.seed`` is one of ``training.seeds``; the MLflow runs and logged models are
    named with it (``train:raw:<run>:seed1``) so they never collide with the base seed's.
    ``launcher``: how ``training.workers_per_point`` > 1 workers start (``pipeline.runner``: local
    processes or Ray Train); their rank 0 reports back here, so the MLflow runs stay this process's.
    """
    tail = f":seed{cfg.seed}" if extra_seed else ""
    set_process_threads(cfg.num_threads)  # once per process: a no-op in the flow's own thread pool
    for d in out_dirs:
        write_json(Path(d) / OWNER_FILE, {"preset": preset, "variant": variant, "seed": cfg.seed})
    if stable_dir is not None:
        write_json(Path(stable_dir) / OWNER_FILE, {"preset": preset, "variant": variant, "seed": cfg.seed})
    val_groups = source_labels(Path(val_groups_path))
    with contextlib.ExitStack() as stack:
        runs, params = {}, {}
        for spec in specs:
            params[spec.name] = {
                "stage": "train", "variant": variant, "data_variant": data_variant or variant, "preset": preset,
                "run": spec.name, "seed": cfg.seed, "n_params": spec.n_params, "n_params_nonembed": spec.n_params,
                "n_params_total": spec.n_params_total,
                "tokens": spec.tokens, "arch": cfg.arch, "schedule": cfg.schedule, "lr": spec.lr,
                "data_pruning": "repb" if cfg.repb.enabled else "none", "compute_budget": spec.compute_budget,
                "d_model": spec.shape.d_model, "n_layers": spec.shape.n_layers, "n_heads": spec.shape.n_heads,
                "steps": spec.steps, "point": spec.point,
            }
            runs[spec.name] = stack.enter_context(tracked_run(
                f"train:{variant}:{spec.name}{tail}", uri=parent.uri, experiment=parent.experiment, parent=parent,
                params=params[spec.name], tags={"scalelab.stage": "train"}))
            if data is not None:
                log_datasets(runs[spec.name], data[:1], "training")
                log_datasets(runs[spec.name], data[1:], "evaluation")

        def on_metrics(spec):
            return lambda m, step: runs[spec.name].log_metrics(m, step=step)

        def bar(spec):
            return progress(spec) if progress is not None else None

        job = PointJob(specs=specs, cfg=cfg, train_path=train_path, val_path=val_path, out_dirs=out_dirs,
                       stable_dir=stable_dir, val_groups=val_groups, val_docs_path=val_docs_path)
        results = train_points(job, launcher=launcher, on_metrics=on_metrics, progress=bar)
        rows = []
        for spec, result, out_dir in zip(specs, results, out_dirs):
            run = runs[spec.name]
            row = dataclasses.asdict(result)
            history = row.pop("history", [])
            by_group = row.pop("val_loss_by_group", None) or {}
            for step, train_loss, val_loss in history:  # the steps a branch shared with its stable run
                if step <= result.shared_steps:
                    run.log_metrics({"train_loss": train_loss, "val_loss": val_loss}, step=step)
            final = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            run.log_metrics(final | {"flops": result.flops_total, "diverged": int(result.diverged)}
                            | {f"val_loss.{g}": v["val_loss"] for g, v in by_group.items()})
            if result.diverged:
                run.set_tags({"scalelab.diverged": result.diverged_reason})
                print(f"train: {variant}/{spec.name} DIVERGED ({result.diverged_reason}); recorded, excluded from fits")
            if result.epochs > 1:
                print(f"train: WARNING {variant}/{spec.name} made {result.epochs:.2f} passes over its training tokens")
            model_id = None
            if not result.diverged:  # a diverged run has no model
                model_id = log_model_ref(
                    run, f"{variant}-{spec.name}{tail.replace(':', '-')}",
                    {"kind": "trained", "model_dir": str(Path(out_dir).resolve())},
                    key=f"{variant}/{spec.name}{tail.replace(':', '/')}", model_type="scalelab-trained", params=params[spec.name],
                    metrics={"val_loss": result.val_loss, "ppl": math.exp(result.val_loss)
                             if math.isfinite(result.val_loss) else None},
                    dataset=data[1] if data is not None else None)
            rows.append({"variant": variant, "run": spec.name, **params[spec.name], **final,
                         "diverged": result.diverged, "diverged_reason": result.diverged_reason,
                         "history": history, "by_source": by_group, "model_id": model_id})
        return rows


VAL_DOCS_COLUMNS = ("variant", "data_variant", "run", "seed", "n_params_total", "tokens_trained", "compute_budget",
                    "doc", "source", "tokens", "loss_sum")


def val_docs_table(rows: list[dict], out_dirs: list[Path], doc_sources: list[str]) -> pl.DataFrame:
    """One row per (series, run, seed, validation document) with the run's summed loss on it.

    ``rows`` (train_size's) pair with ``out_dirs``; diverged runs have no model and no rows.
    ``doc_sources[d]`` is the corpus source of validation document ``d``. ``tokens`` counts the
    document's scored targets and ``loss_sum`` their summed loss (nats); ``tokens_trained`` is the
    run's D. Every (variant, seed) pair of a run scores the same documents, so two variants'
    losses pair up on ``doc``.
    """
    schema = {"variant": pl.String, "data_variant": pl.String, "run": pl.String, "seed": pl.Int64,
              "n_params_total": pl.Int64, "tokens_trained": pl.Int64, "compute_budget": pl.Float64,
              "doc": pl.Int64, "source": pl.String, "tokens": pl.Int64, "loss_sum": pl.Float64}
    sources = pl.Series("source", doc_sources, dtype=pl.String)
    parts = []
    for r, d in zip(rows, out_dirs):
        if r["diverged"] or r.get(STATUS) == FAILED:  # no model, no document losses
            continue
        docs = read_doc_losses(d)
        if len(docs) and int(docs["doc"].max()) >= len(sources):
            raise ValueError(f"{d}: doc_losses.parquet names document {int(docs['doc'].max())}, but the validation "
                             f"split has {len(sources)}; it was scored on another split, delete the folder to retrain")
        parts.append(docs.select(
            pl.lit(r["variant"]).alias("variant"), pl.lit(r.get("data_variant") or r["variant"]).alias("data_variant"),
            pl.lit(r["run"]).alias("run"), pl.lit(r["seed"]).alias("seed"),
            pl.lit(r["n_params_total"]).alias("n_params_total"), pl.lit(r["tokens"]).alias("tokens_trained"),
            pl.lit(r.get("compute_budget")).alias("compute_budget"), pl.col("doc"),
            sources.gather(docs["doc"]).alias("source"), pl.col("tokens"), pl.col("loss_sum"),
        ).cast(schema))
    return pl.concat(parts) if parts else pl.DataFrame(schema=schema)


def register_best_models(run, rows: list[dict]) -> dict[str, str]:
    """Register each series' best model per budget (lowest validation loss among its runs that did
    not diverge) in the MLflow Model Registry as ``<series>@best-<budget>``: the IsoFLOP compute
    budget (``raw@best-1e13``), or under a sizes x tokens grid the token budget (``raw@best-8192``).
    Returns ``{alias as "name@alias": model_id}``."""
    best: dict[tuple[str, str], dict] = {}
    for r in rows:
        # an anneal point (training.extra_branches) is no point of the design's budgets
        if r.get("model_id") is None or not math.isfinite(r["val_loss"]) or r.get("point") == "anneal":
            continue
        budget = budget_label(r["compute_budget"]) if r.get("compute_budget") else budget_label(r["tokens"])
        key = (r["variant"], budget)
        if key not in best or r["val_loss"] < best[key]["val_loss"]:
            best[key] = r
    out = {}
    for (series, budget), r in sorted(best.items()):
        alias = f"best-{budget}"
        register_alias(run.uri, series, r["model_id"], alias, run_id=run.run_id,
                       tags={"run": r["run"], "val_loss": f"{r['val_loss']:.6g}"})
        out[f"{series}@{alias}"] = r["model_id"]
    return out


def size_jobs(cfg: TrainingConfig, specs: list[RunSpec]) -> list[list[RunSpec]]:
    """Units of work: a size's every budget under WSD (one stable run feeds them), else one point each."""
    if cfg.schedule != "wsd":
        return [[s] for s in specs]
    by_size: dict[str, list[RunSpec]] = {}
    for s in specs:
        by_size.setdefault(s.size, []).append(s)
    # the costliest sizes first, so the last task to finish is a small one
    return sorted(by_size.values(), key=lambda group: -max(s.flops_per_token * s.tokens for s in group))


def run_ladder(ctx: Context, cfg: TrainingConfig, jobs: list[dict], parent: RunRef,
               units: StageUnits | None = None) -> list[dict]:
    """Fan the ladder's units out through the context's task runner (progress bars when local).

    With ``units``, a unit that fails leaves the others running and keeps one row per point,
    marked failed (:func:`failed_train_rows`); the rows come in the jobs' order either way."""
    local = ctx.pipeline.runner == "local"
    with progress_bars(enabled=local) as bars:
        def progress_for(label):
            return (lambda spec: bars.bar(f"{label}/{spec.name}", spec.steps)) if local else None

        jobs = [dict({"cfg": cfg} | job, parent=parent, preset=ctx.preset, progress=progress_for(job["variant"]),
                     launcher=ctx.pipeline.runner) for job in jobs]
        # W > 1: the point's Ray Train workers ask for the GPUs, not the task that launches them
        gpu = cfg.workers_per_point == 1
        if units is None:
            return [row for rows in map_tasks(ctx.pipeline, train_size, jobs, gpu=gpu) for row in rows]
        names = [train_unit_name(job) for job in jobs]
        results = units.map(train_size, jobs, names, gpu=gpu)
        return [row for job, name, rows in zip(jobs, names, results)
                for row in (mark_ok(rows) if rows is not None else failed_train_rows(job, units.failed_rows(name, [{}])[0]))]


def train_unit_name(job: dict) -> str:
    """``<series>/<point>`` (cosine: one point a unit) or ``<series>/<size>`` (WSD: a size's budgets), then
    ``:seed<n>`` for an extra seed's unit."""
    specs = job["specs"]
    point = specs[0].name if len(specs) == 1 else specs[0].size
    return f"{job['variant']}/{point}" + (f":seed{job['cfg'].seed}" if job.get("extra_seed") else "")


def failed_train_rows(job: dict, marks: dict) -> list[dict]:
    """One row per point of a failed unit: the columns naming it (series, run, seed, N, D, budget), no
    metrics, no model; ``marks``: its ``status`` and ``error``."""
    cfg = job["cfg"]
    return [{"variant": job["variant"], "run": spec.name, "stage": "train", "data_variant": job.get("data_variant"),
             "seed": cfg.seed, "n_params": spec.n_params, "n_params_nonembed": spec.n_params,
             "n_params_total": spec.n_params_total, "tokens": spec.tokens, "arch": cfg.arch, "schedule": cfg.schedule,
             "compute_budget": spec.compute_budget, "point": spec.point, "diverged": None, "history": [],
             "by_source": {}, "model_id": None} | marks for spec in job["specs"]]


def remove_stale_models(trained: Path, labels: set[str], preset: str, keep: set[Path]) -> list[Path]:
    """Delete model folders this flow owns that the current ladder no longer has: same preset, a
    series trained now, not in ``keep``. Folders of other presets or variants, and folders with no
    owner record, are left alone. Returns what was removed."""
    removed = []
    for label in sorted(labels):
        for d in sorted((trained / label).iterdir()) if (trained / label).is_dir() else []:
            owner = d / OWNER_FILE
            if d.is_dir() and d not in keep and owner.exists():
                rec = read_json(owner)
                if rec.get("preset") == preset and rec.get("variant") == label:
                    shutil.rmtree(d)
                    removed.append(d)
    return removed


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
    check_parallel(cfg, launcher=ctx.pipeline.runner)  # more workers than devices: refused before any work
    layout = ctx.layout
    set_process_threads(cfg.num_threads)  # per process, before the thread pool starts
    with stage_run(ctx, "train", cfg) as run:
        tokenizer = ensure_tokenizer(ctx, cfg)
        val_path, val_groups, val_docs = ensure_val_tokens(tokenizer, layout.prepared / "val.parquet",
                                                           layout.tokens / "val.npy", layout.tokenizer)
        variants = curated_variants(layout.curated, cfg.variants)
        not_trained = [v for v in cfg.repb.compare if v not in variants]
        if not_trained:
            raise ValueError(f"training.repb.compare names {not_trained[0]!r}, not among the trained variants {variants}")
        not_trained = [v for v in cfg.arch_compare if v not in variants]
        if not_trained:
            raise ValueError(f"training.arch_compare names {not_trained[0]!r}, not among the trained variants {variants}")
        token_paths = {v: ensure_tokens(tokenizer, layout.curated / v / "kept.parquet", layout.tokens / f"{v}.npy",
                                        layout.tokenizer) for v in variants}
        # Before any training: each variant's ladder as its tokens allow (training.feasibility)
        cfg, feas = checked_ladder(ctx, cfg, {v: len(load_tokens(p)) for v, p in token_paths.items()},
                                   len(load_tokens(val_path)), run)
        specs = ladder(cfg)
        seeded = seed_sizes(cfg, specs)  # the sizes the extra seeds retrain; raises naming seed_sizes
        jobs, keep_dirs, labels = [], set(), set()
        val_ref = data_ref(ctx.workdir, val_path, "val")
        for variant in feas.trained:
            train_path = token_paths[variant]
            log_datasets(run, [data_ref(ctx.workdir, layout.curated / variant / "kept.parquet", variant)], "training")
            data = (data_ref(ctx.workdir, train_path, variant), val_ref)
            digest = file_digest(train_path, val_path)
            # A variant in training.repb.compare also trains pruned, reported as <variant>+repb, and
            # one in training.arch_compare with the other architecture, as <variant>+xlstm (or +llama).
            for suffix, arm_cfg in training_arms(cfg, variant):
                # an arch arm trains the same points (names, steps), counted for its architecture
                arm_specs = feas.ladders[variant]
                arm_specs = arm_specs if arm_cfg.arch == cfg.arch else arch_specs(arm_specs, arm_cfg)
                label = variant + suffix
                labels.add(label)
                # Extra seeds retrain the plain arm only: RePB's comparison arm stays base-seed.
                for seed in (arm_cfg.seed, *(cfg.seeds if not suffix else ())):
                    extra = seed != arm_cfg.seed
                    seed_cfg = dataclasses.replace(arm_cfg, seed=seed, seeds=(), seed_sizes=()) if extra else arm_cfg
                    key = folder_key(seed_cfg)
                    for group in size_jobs(cfg, arm_specs):
                        if extra and group[0].size not in seeded:
                            continue
                        # Keyed by what made it, so a changed config or corpus never reuses a stale result.
                        out_dirs = [layout.trained / label / f"{spec.name}-{config_hash(key, spec.key(), digest)}" for spec in group]
                        stable = None
                        if cfg.schedule == "wsd":
                            stable = layout.trained / label / f"stable-{group[0].size}-{config_hash(key, group[0].size, digest)}"
                            keep_dirs.add(stable)
                        keep_dirs.update(out_dirs)
                        jobs.append(dict(variant=label, data_variant=variant, specs=group, cfg=seed_cfg,
                                         train_path=str(train_path), val_path=str(val_path),
                                         val_groups_path=str(val_groups), val_docs_path=str(val_docs),
                                         out_dirs=[str(d) for d in out_dirs], extra_seed=extra,
                                         stable_dir=str(stable) if stable else None, data=data))
        units = StageUnits(ctx, run, "train")
        all_rows = run_ladder(ctx, cfg, jobs, run.ref(), units)
        units.close()
        for d in remove_stale_models(layout.trained, labels, ctx.preset, keep_dirs):
            print(f"train: removed {d} (this preset's output of an older ladder)")
        # Model folders relative to the workdir, so the table stays valid in a moved copy (dvc exp --temp).
        all_dirs = [Path(d) for job in jobs for d in job["out_dirs"]]
        for r, d in zip(all_rows, all_dirs):
            r["model_dir"] = str(d.relative_to(ctx.workdir)) if r[STATUS] == OK else None
        # Extra-seed runs go to train_seeds.csv only: every stage downstream reads train.csv as one
        # run per ladder point, and the registry's best-per-budget models stay base-seed models.
        rows = [r for r in all_rows if r["seed"] == cfg.seed]
        seed_rows = [r for r in all_rows if r["seed"] != cfg.seed]
        curves = [
            {"variant": r["variant"], "run": r["run"], "n_params": r["n_params"], "n_params_total": r["n_params_total"],
             "step": h[0], "train_loss": h[1], "val_loss": h[2]}
            for r in rows for h in r["history"]
        ]
        by_source = [{"run": r["run"], "variant": r["variant"], "source": src, "tokens": v["tokens"],
                      "val_loss": v["val_loss"]} for r in rows for src, v in sorted(r["by_source"].items())]
        aliases = register_best_models(run, rows)
        frame = pl.DataFrame([{k: v for k, v in r.items() if k not in ("history", "by_source", "stage", "preset", "model_id")}
                              for r in all_rows], infer_schema_length=None)
        table = frame.filter(pl.col("seed") == cfg.seed)
        write_table(ctx, "train", table, run)
        # same columns as train.csv, header only when there are no extra seeds (a DVC out always exists)
        write_table(ctx, "train_seeds", frame.filter(pl.col("seed") != cfg.seed), run)
        publish_table(run, "train", ctx.preset, train_table(rows, aliases),
                      "Training: the best run of each series per budget, registered in the MLflow Model Registry",
                      f"{len(rows)} runs; all of them in reports/train.csv and the MLflow Models tab.")
        write_table(ctx, "train_curves", curves, run)
        write_table(ctx, "val_by_source", by_source, run)
        doc_sources = pl.read_parquet(layout.prepared / "val.parquet", columns=["source"])["source"].to_list()
        with atomic_path(layout.reports / "val_docs.parquet") as tmp:
            val_docs_table(all_rows, all_dirs, doc_sources).write_parquet(tmp)
        run.log_artifact(layout.reports / "val_docs.parquet", "reports")
        diverged = [r["run"] for r in rows if r["diverged"]]
        multi_epoch = [r["run"] for r in rows if (r.get("epochs") or 0) > 1]
        run.log_metrics({"runs": len(rows), "seed_runs": len(seed_rows), "diverged_runs": len(diverged),
                         "multi_epoch_runs": len(multi_epoch)})
        print(f"train: {len(rows)} runs over {len(feas.trained)} variants -> {layout.reports / 'train.csv'}"
              + (f"; {len(seed_rows)} extra-seed runs -> {layout.reports / 'train_seeds.csv'}" if seed_rows else "")
              + (f"; {len(diverged)} diverged" if diverged else "")
              + (f"; WARNING {len(multi_epoch)} runs above 1 epoch" if multi_epoch else "")
              + (f"; {len(units.failures)} unit(s) FAILED -> reports/failures/train.csv" if units.failures else ""))
        return table.to_dicts()
