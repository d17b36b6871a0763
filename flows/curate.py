"""Stage 1, curate: build every active data variant (a recipe of interventions) from the prepared corpus.

Run: ``scalelab run curate [--preset ci]``. Writes ``data/curated/<variant>/{kept,dropped}.parquet``
and ``stats.json`` per variant, ``reports/curation.csv`` (one row per variant, a column per drop
reason, ``val_decontaminated`` documents removed for repeating validation text) and
``reports/curation.json``; one MLflow child run per variant.

Each variant goes through the sharded engine (:func:`tasks.curation.sharded.curate_corpus`) over
the prepared train shards, ``curation.shard_docs`` documents a shard, ``curation.n_workers``
processes (one pool for every variant; 1 = in this process), or Ray tasks under ``runner: ray``.
The engine's resumable parts (``.shards/``) live inside the stage's temporary output folder and
are removed once a variant is written, so ``data/curated`` holds only the files above; a killed
stage starts its variants again (the prepared corpus is sized for the pipeline), while ``scalelab
curate`` keeps the parts of a large corpus across runs.

Rewrites are cached in ``data/rewrite_cache/`` (outside DVC's outputs), so an interrupted or
repeated rewrite step only generates documents it has not done yet.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

import polars as pl
from prefect import flow

from flows.artifacts import curation_table, publish_table
from flows.ray_executor import RayExecutor
from flows.runtime import Context
from flows.stage import stage_context, stage_run, write_table
from tasks.common.config import ConfigError, from_mapping, load_yaml
from tasks.common.io import atomic_dir, clean_temporaries, read_json, write_json, write_parquet
from tasks.common.lineage import data_ref, log_datasets
from tasks.common.lock import workdir_lock
from tasks.common.params import default_preset, load_stage_config, params_root
from tasks.curation.crawl import token_counter
from tasks.curation.decontam import ValDecontaminator
from tasks.curation.dedup import DedupIndex, build_index, load_index, save_index
from tasks.curation.prepare import PrepareConfig, SourceSpec
from tasks.curation.recipes import CurationConfig, FilterCache, Recipe
from tasks.curation.rewrite import DocumentRewriter, generator_key
from tasks.curation.sharded import Executor, check_inputs, curate_corpus
from tasks.curation.text import TokenCount, whitespace_words

#: A variant's stats.json: the in-memory engine's keys (:func:`tasks.curation.recipes.run_recipe`).
#: The sharded engine's input counters (records read, quarantined) are checked, not reported:
#: prepare already quarantined the corpus's bad records.
VARIANT_STATS = ("docs_in", "docs_kept", "docs_dropped", "words_in", "words_kept", "tokens_in", "tokens_kept",
                 "token_count", "docs_rewritten", "dropped_by_reason", "steps")


def prepared_train_files(prepared: Path) -> list[Path]:
    """The prepared train split's shard files, in order."""
    shards = sorted((prepared / "train").glob("shard-*.parquet"))
    if not shards:
        raise FileNotFoundError(f"{prepared / 'train'}: no prepared shards; run `scalelab run prepare` first")
    return shards


def read_prepared_val(prepared: Path) -> pl.DataFrame:
    path = prepared / "val.parquet"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no prepared validation split; run `scalelab run prepare` first")
    return pl.read_parquet(path)


def variant_row(variant: str, stats: dict) -> dict:
    """One flat row of reports/curation.csv: counts plus ``dropped.<reason>`` columns, and the
    validation n-gram share in training text before/after decontamination when it ran."""
    row = {"variant": variant}
    row |= {k: v for k, v in stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    row |= {f"dropped.{r}": n for r, n in sorted(stats.get("dropped_by_reason", {}).items())}
    for step in stats.get("steps", []):
        if step.get("kind") == "val_decontamination":
            row["val_decontaminated"] = step["docs_in"] - step["docs_out"]
            row["val_ngram_share_before"] = step["val_ngram_share_before"]
            row["val_ngram_share_after"] = step["val_ngram_share_after"]
    return row


def read_dedup_index(cfg: CurationConfig, docs: pl.DataFrame, root: Path = Path(".")):
    """The pipeline's ``curation.index``: read only (``update`` is for ``scalelab curate``, since the
    stage builds several variants of one corpus), refused when it already holds ``docs``' ids. A
    relative path is taken from the project ``root``. DVC does not see the index folder: after
    changing its contents, rerun with ``dvc repro -f curate``."""
    if cfg.index.path is None:
        return None
    if cfg.index.update:
        raise ConfigError("params/curation.yaml: curation.index.update: the pipeline's curate stage reads an "
                          "index but does not extend one; extend it with `scalelab curate --index DIR --index-update`")
    try:
        index = load_index(Path(root) / cfg.index.path)
        for recipe in (cfg.variants[v] for v in cfg.active):
            index.minhash_config_for([s.settings for s in recipe.steps if s.kind == "minhash"])
        index.refuse_indexed(docs["id"])
    except ValueError as exc:
        raise ConfigError(f"params/curation.yaml: curation.index.path: {exc}") from None
    return index


@contextlib.contextmanager
def curation_executor(ctx: Context, n_workers: int) -> Iterator[Executor | None]:
    """What runs the sharded engine's work for every variant of the stage: Ray tasks under
    ``runner: ray``, else one spawned process pool of ``n_workers`` (started once, not per
    variant: a spawn costs seconds), or None (in this process) when ``n_workers`` is 1."""
    if ctx.pipeline.runner == "ray":
        with RayExecutor(address=ctx.pipeline.ray_address, num_cpus=ctx.pipeline.ray_num_cpus) as executor:
            yield executor
    elif n_workers > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(n_workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            yield pool
    else:
        yield None


def curate_variant(train_files: Sequence[Path], folder: Path, recipe: Recipe, cfg: CurationConfig, *,
                   executor: Executor | None = None, rewriter: DocumentRewriter | None = None,
                   filter_cache: FilterCache | None = None, decontaminate: ValDecontaminator | None = None,
                   index: DedupIndex | None = None, token_count: TokenCount = whitespace_words) -> dict:
    """One variant of the prepared train split through the sharded engine into ``folder``:
    ``kept.parquet``, ``dropped.parquet`` and ``stats.json`` (:data:`VARIANT_STATS`), the same
    as :func:`tasks.curation.recipes.run_recipe` gives on the split read whole. The engine's
    parts and its (empty) quarantine are removed. Returns the stats. ``token_count``: what the
    ``tokens_*`` counts (``curation.token_count``)."""
    stats = curate_corpus(train_files, folder, recipe, n_workers=cfg.n_workers, shard_docs=cfg.shard_docs,
                          executor=executor, rewriter=rewriter, index=index, decontaminate=decontaminate,
                          filter_cache=filter_cache, token_count=token_count)
    if stats["quarantined"]:
        raise ValueError(f"{train_files[0].parent}: {stats['quarantined']} prepared train records are not usable "
                         f"documents ({stats['quarantined_by_reason']}); rerun `scalelab run prepare`")
    shutil.rmtree(folder / ".shards")
    (folder / "quarantine.parquet").unlink()
    stats = {k: stats[k] for k in VARIANT_STATS}
    write_json(folder / "stats.json", stats)
    return stats


@flow(name="curate", log_prints=True)
def curate_flow(
    root: str = ".",
    preset: str | None = None,
    workdir: str | None = None,
    runner: str | None = None,
    parent_run_id: str | None = None,
) -> list[dict]:
    ctx = stage_context(root, preset, workdir, runner, parent_run_id)
    cfg = ctx.config(CurationConfig, "curation")
    layout = ctx.layout
    rows = []
    with stage_run(ctx, "curate", cfg) as run:
        train_files = prepared_train_files(layout.prepared)
        log_datasets(run, [data_ref(ctx.workdir, layout.prepared / "train", "prepared-train")], "training")
        outputs = []
        cache_dir = layout.data / "rewrite_cache"
        rewriter = None
        if any(cfg.variants[v].needs_rewriter for v in cfg.active):
            previous = pl.read_parquet(cache_dir / "rewrites.parquet") if (cache_dir / "rewrites.parquet").exists() else None
            rewriter = DocumentRewriter.from_config(cfg.rewrite, previous=previous)
        filter_cache = FilterCache()  # variants sharing a filter judge each text once
        # curate runs before train trains the pipeline's tokenizer: its counts are words unless
        # curation.token_count names a tokenizer file (relative to the project root)
        token_count = token_counter(cfg.token_count, ctx.root)
        ids = pl.concat([pl.read_parquet(f, columns=["id"]) for f in train_files])
        index = read_dedup_index(cfg, ids, ctx.root)
        deco = None
        if cfg.decontamination.enabled:
            deco = ValDecontaminator.from_val(read_prepared_val(layout.prepared)["text"], cfg.decontamination)
        with atomic_dir(layout.curated) as out, curation_executor(ctx, cfg.n_workers) as executor:
            for variant in cfg.active:
                recipe = cfg.variants[variant]
                with stage_run(ctx.with_parent(run.ref()), "curate", run_name=f"curate:{variant}", variant=variant,
                               recipe=[s.kind for s in recipe.steps]) as child:
                    try:
                        stats = curate_variant(train_files, out / variant, recipe, cfg, executor=executor,
                                               rewriter=rewriter, filter_cache=filter_cache, decontaminate=deco,
                                               index=index, token_count=token_count)
                    finally:
                        if rewriter is not None:  # keep finished generations even if the step failed
                            write_parquet(cache_dir / "rewrites.parquet", rewriter.results)
                    row = variant_row(variant, stats)
                    child.log_metrics({k: v for k, v in row.items() if k != "variant"})
                    made = data_ref(ctx.workdir, out / variant / "kept.parquet", variant,
                                    at=layout.curated / variant / "kept.parquet")
                    log_datasets(child, [made], "output")
                    outputs.append(made)
                    rows.append(row)
                    print(f"curate: {variant}: kept {stats['docs_kept']} of {stats['docs_in']} docs")
        log_datasets(run, outputs, "output")
        write_table(ctx, "curation", rows, run)
        publish_table(run, "curation", ctx.preset, curation_table(rows), "Curation: documents kept per variant",
                      "Each variant's own MLflow run is a child of this one; full table: reports/curation.csv.")
        write_json(layout.reports / "curation.json", {r["variant"]: {k: v for k, v in r.items() if k != "variant"} for r in rows})
    return rows


def load_recipe(recipe: str, recipe_file: Path | None, root: Path, preset: str | None):
    """A named recipe from ``recipe_file`` (a YAML with a ``curation:`` section) or params/curation.yaml
    of ``root`` (:func:`tasks.common.params.params_root`: the packaged defaults when ``root`` has no
    params/)."""
    if recipe_file is None:
        root = params_root(root)
        cfg = load_stage_config(CurationConfig, root, "curation", preset or default_preset(root))
        source = str(root / "params" / "curation.yaml")
    else:
        data, lines = load_yaml(recipe_file)
        if "curation" not in data:
            raise ConfigError(f"{recipe_file}: expected a top-level `curation:` section")
        section = dict(data["curation"])
        section.setdefault("active", [recipe])
        cfg = from_mapping(CurationConfig, section, source=str(recipe_file), prefix="curation", lines=lines)
        source = str(recipe_file)
    if recipe not in cfg.variants:
        raise ConfigError(f"{source}: no recipe named {recipe!r}; defined: {', '.join(sorted(cfg.variants))}")
    return cfg, cfg.variants[recipe]


def params_sources(root: Path, preset: str | None) -> tuple[SourceSpec, ...]:
    """``prepare.sources`` of ``root``'s params (or the packaged defaults'): what ``scalelab curate``
    reads without ``--input``, through the same specs and adapters as the prepare stage (files as
    the stage reads them, from the current folder; no per-source cap or validation split)."""
    root = params_root(root)
    return load_stage_config(PrepareConfig, root, "prepare", preset or default_preset(root)).sources


def curate_any(
    *, inputs: list[Path] | None, out: Path, recipe: str, recipe_file: Path | None, root: Path,
    preset: str | None = None, workers: int = 2, runner: str = "local",
    rewrite: dict | None = None, generator=None, index: Path | None = None, index_update: bool | None = None,
    text_field: str = "text", id_field: str | None = "id", token_count: str | None = None,
) -> dict:
    """``scalelab curate``: one recipe over any JSONL/Parquet corpus, sharded and resumable.

    ``inputs``: files and globs whose records hold their text and id under ``text_field`` and
    ``id_field`` (keys or dotted paths); None = the sources of ``prepare.sources``
    (:func:`params_sources`), so the pipeline's sources curate here too. Params come from
    ``root/params``, or the packaged defaults when ``root`` has none
    (:func:`tasks.common.params.params_root`; the result's ``params`` says which).

    ``out`` has one writer at a time (:func:`tasks.common.lock.workdir_lock`); temporaries a killed
    run left there are removed first, and its finished shards are reused.

    A recipe with a rewrite step gets a :class:`DocumentRewriter` built from the recipe file's
    ``curation.rewrite`` section with ``rewrite`` applied over it (the CLI's ``--rewrite-kind``,
    ``--base-url``, ``--model`` as ``kind``/``base_url``/``model``); ``generator`` replaces the
    generator it describes (tests). Rewrites are cached in ``out/rewrite_cache/rewrites.parquet``
    under their generator key. While documents are left to rewrite (budget or
    ``max_docs_per_run`` spent), the rewrite segment and the ones after it are reopened, so the
    next run resumes generating instead of reusing a half-done step; ``run.rewrite_pending`` in
    the result counts them.

    Token statistics (and mix ratios) are counted by ``token_count`` (``--token-count``: ``words``
    or ``tokenizer:<path>``, a relative path from the current folder), else by
    ``curation.token_count`` of the recipe file or params (a relative path from their project
    root); by default whitespace words, which cost little and need no tokenizer. ``stats.json``'s
    ``token_count`` names the counter.

    Dedup against an earlier corpus: ``index`` (``--index DIR``, else ``curation.index.path`` of
    the recipe file) is a folder written by an earlier run with ``index_update``
    (``--index-update``, else ``curation.index.update``). Its documents win every exact or MinHash
    cluster, so this corpus's copies of them are dropped with ``duplicate_of`` naming the indexed
    id. With ``index_update``, the kept documents (``out/kept.parquet`` as written) are then added
    to the index, which is created when the folder does not exist yet and replaced whole
    (:func:`tasks.common.io.atomic_dir`), MinHash signatures made with the index's settings (or
    the recipe's minhash step for a new index). The result's ``index`` says what was read and
    added.
    """
    import dataclasses

    cfg, chosen = load_recipe(recipe, recipe_file, root, preset)
    used_root = params_root(root)
    gen_cfg = None
    if chosen.needs_rewriter:  # build (and validate) the generator config before touching `out`
        try:
            gen_cfg = dataclasses.replace(cfg.rewrite, **{k: v for k, v in (rewrite or {}).items() if v is not None})
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{recipe_file or root / 'params' / 'curation.yaml'}: curation.rewrite: {exc}") from None
    idx_cfg = cfg.index
    if index is not None or index_update is not None:
        try:
            idx_cfg = dataclasses.replace(cfg.index, **{k: v for k, v in
                                                        (("path", None if index is None else str(index)),
                                                         ("update", index_update)) if v is not None})
        except ValueError as exc:
            raise ConfigError(f"--index-update: {exc} (give --index DIR)") from None
    dedup_index, index_cfg = _open_index(idx_cfg, chosen)
    try:
        counter = (token_counter(token_count, Path.cwd()) if token_count is not None
                   else token_counter(cfg.token_count, used_root))
    except (ValueError, FileNotFoundError) as exc:
        where = "--token-count" if token_count is not None else f"{recipe_file or used_root / 'params' / 'curation.yaml'}: curation.token_count"
        raise ConfigError(f"{where}: {str(exc).removeprefix('token_count: ')}") from None
    sources = check_inputs(params_sources(root, preset) if inputs is None else inputs, text_field=text_field,
                           id_field=id_field)  # before the lock creates `out`: refused input leaves nothing behind
    executor = None
    if runner == "ray":
        executor = RayExecutor()
    with workdir_lock(out) as lock:
        if lock.fresh:
            clean_temporaries(out)
        rewriter = None
        cache = out / "rewrite_cache" / "rewrites.parquet"
        if gen_cfg is not None:
            previous = pl.read_parquet(cache) if cache.exists() else None
            rewriter = DocumentRewriter.from_config(gen_cfg, previous=previous, generator=generator)
            # The sharded engine's fingerprint covers the recipe and inputs, not the generator: parts
            # made under another generator key are reopened so the new one rewrites.
            keys = {s.settings.style: generator_key(gen_cfg, s.settings.style) for s in chosen.steps if s.kind == "rewrite"}
            used = out / "rewrite_cache" / "generator_keys.json"
            if used.exists() and read_json(used) != keys:
                reopen_rewrite_segments(out / ".shards")
            write_json(used, keys)
        try:
            stats = curate_corpus(sources, out, chosen, n_workers=workers, shard_docs=cfg.shard_docs,
                                  executor=executor, rewriter=rewriter, token_count=counter,
                                  index=dedup_index)
        finally:
            if rewriter is not None:  # keep finished generations even if a step failed
                write_parquet(cache, rewriter.results)
        if idx_cfg.path is not None:
            stats["index"] = {"path": idx_cfg.path, "docs_before": len(dedup_index), "docs_added": 0}
            if idx_cfg.update:
                stats["index"] |= _extend_index(dedup_index, index_cfg, Path(idx_cfg.path), out, sources,
                                                workers=workers, executor=executor)
        pending = sum(s.get("rewrite_pending", 0) for s in stats.get("steps", []) if s.get("step") == "rewrite")
        if pending:
            reopen_rewrite_segments(out / ".shards")
        stats["run"]["rewrite_pending"] = pending
        stats["params"] = str(used_root / "params") if recipe_file is None or inputs is None else str(recipe_file)
        return stats


def _open_index(idx_cfg, recipe):
    """The index a run reads (empty when ``update`` creates a new folder) and the MinHash
    settings it holds or will hold; every refusal (missing folder, bad files, other MinHash
    settings, no signatures for a minhash step) comes before anything is written."""
    if idx_cfg.path is None:
        return None, None
    folder = Path(idx_cfg.path)
    if idx_cfg.update and not folder.exists():
        index = DedupIndex()
    else:
        try:
            index = load_index(folder)
        except ValueError as exc:
            raise ConfigError(f"{exc}{'' if idx_cfg.update else '; to create it, add --index-update'}") from None
    try:
        index_cfg = index.minhash_config_for([s.settings for s in recipe.steps if s.kind == "minhash"])
    except ValueError as exc:
        raise ConfigError(f"{folder}: {exc}") from None
    return index, index_cfg


def _extend_index(index, index_cfg, folder: Path, out: Path, inputs: Sequence[SourceSpec], *, workers: int,
                  executor) -> dict:
    """Add ``out/kept.parquet``'s documents to ``index`` and write it to ``folder`` whole."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from datetime import datetime, timezone

    kept = pl.read_parquet(out / "kept.parquet", columns=["id", "text"])
    own_pool = None
    if executor is None and workers > 1 and index_cfg is not None and kept.height:
        own_pool = executor = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    try:
        added = build_index(kept["text"], kept["id"], index_cfg, executor=executor,
                            n_shards=max(1, workers) if executor is not None else 1)
    finally:
        if own_pool is not None:
            own_pool.shutdown()
    grown = index.extended(exact=added.exact, minhash_ids=added.minhash_ids, minhash_sig=added.minhash_sig,
                           cfg=index_cfg)
    grown.history.append({"out": str(out), "inputs": [str(p) for s in inputs for p in (s.files or (s.kind,))],
                          "docs_added": kept.height,
                          "at": datetime.now(timezone.utc).isoformat(timespec="seconds")})
    with atomic_dir(folder) as tmp:
        save_index(grown, tmp)
    return {"docs_added": kept.height, "docs_after": len(grown)}


def reopen_rewrite_segments(parts: Path) -> list[Path]:
    """Remove the sharded engine's finished parts from the rewrite segment on (``seg<k>-rewrite``
    and every ``seg<j>*`` with ``j >= k``), so a rerun recomputes them from the rewrite cache.
    Returns the folders removed."""
    import shutil

    rewrite_segs = sorted(parts.glob("seg*-rewrite"))
    if not rewrite_segs:
        return []
    first = int(rewrite_segs[0].name[3:5])
    removed = [f for f in sorted(parts.glob("seg*")) if f.is_dir() and int(f.name[3:5]) >= first]
    for f in removed:
        shutil.rmtree(f)
    return removed
