"""Sharded, resumable curation of a user corpus: the engine behind ``scalelab curate``.

    scalelab curate --input data/*.jsonl --out out/curated --recipe dedup_gopher

:func:`curate_corpus` reads JSONL (plain, ``.gz``, ``.zst``) and Parquet inputs, files or globs
(bad lines quarantined with file and line), then runs the recipe in *segments*: a run of
per-document steps (heuristic filters) is applied shard by shard in parallel; a step that needs
the whole corpus (``exact_dedup``, ``minhash``, ``rewrite``, ``mix``) runs once over the union of
the shards — MinHash signatures still shard by shard through the executor — so dedup is global,
and its result (which copy is kept: the lowest id) is the same as a single-process run.

Memory: the documents are held in memory as one Arrow frame (about the corpus's text size plus
per-segment copies), not streamed; ``benchmarks/curation_scale.py`` measures the peak.

Every shard and every global step writes its outputs under ``out_dir/.shards/``
and then a ``DONE`` marker; a rerun after a crash reuses finished parts and
recomputes the rest, giving identical final files. ``.shards/manifest.json`` holds
a fingerprint of inputs, recipe and shard size: when it differs, old parts are
discarded rather than mixed with new ones.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import polars as pl

from tasks.common.config import require, to_dict
from tasks.common.faults import fault_point
from tasks.common.io import read_json, write_json, write_parquet, write_text
from tasks.curation.dedup import DedupIndex
from tasks.curation.prepare import drop_duplicate_ids, shard_frame
from tasks.curation.recipes import (
    DROPPED_SCHEMA,
    Recipe,
    TokenCount,
    apply_step,
    curation_stats,
    finalize,
    whitespace_words,
)
from tasks.curation.sources import JSONL_SUFFIXES, JsonlSource, ParquetSource, expand_paths, read_source

MARKER = "DONE"


class Executor(Protocol):
    """What :func:`curate_corpus` needs of an executor: ``concurrent.futures``' ``submit``."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future: ...


class SerialExecutor:
    """Runs each submitted call at once in this process (debugging, tests, ``n_workers=1``)."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 — delivered through the future, like a pool
            fut.set_exception(exc)
        return fut


def check_inputs(input_paths: Sequence[str | Path]) -> tuple[list, list]:
    """Refuse unusable inputs before anything is written; return ``(jsonl, parquet)`` paths.

    Cheap: resolves every file and glob and reads only Parquet schemas. ``ValueError`` or
    ``FileNotFoundError`` names the path: a directory, a missing or empty file, an unknown
    extension, a Parquet file without a string ``text`` column.
    """
    require(len(input_paths) > 0, "input_paths", "give at least one file or glob")
    for p in input_paths:
        if Path(p).is_dir():
            raise ValueError(f"{p}: is a directory; give its files or a glob such as {Path(p) / '*.jsonl'}")
    jsonl = [p for p in input_paths if str(p).endswith(JSONL_SUFFIXES)]
    parquet = [p for p in input_paths if str(p).endswith(".parquet")]
    other = [p for p in input_paths if p not in jsonl and p not in parquet]
    require(not other, "input_paths",
            f"{other[0]}: unknown format; expected .jsonl (.jsonl.gz, .jsonl.zst) or .parquet" if other else "")
    expand_paths(jsonl)
    for path, _ in expand_paths(parquet):
        try:
            schema = pl.read_parquet_schema(path)
        except (pl.exceptions.PolarsError, OSError) as exc:
            raise ValueError(f"{path}: not a readable Parquet file ({exc})") from None
        if "text" not in schema:
            raise ValueError(f"{path}: no 'text' column; columns are {list(schema)}")
        if schema["text"] not in (pl.Utf8, pl.String):
            raise ValueError(f"{path}: column 'text' is {schema['text']}, not a string")
    return jsonl, parquet


def read_inputs(input_paths: Sequence[str | Path]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Documents and quarantine from JSONL (``.jsonl``/``.json``/``.ndjson``) and Parquet files or globs
    (checked first by :func:`check_inputs`)."""
    jsonl, parquet = check_inputs(input_paths)
    docs, quarantine = [], []
    for paths, cls in ((jsonl, JsonlSource), (parquet, ParquetSource)):
        if paths:
            d, q = read_source(cls(paths, name=cls.__name__.removesuffix("Source").lower()))
            docs.append(d)
            quarantine.append(q)
    docs_all, quarantine_all = pl.concat(docs), pl.concat(quarantine)
    if docs_all.height == 0 and quarantine_all.height == 0:
        raise ValueError(f"{', '.join(map(str, input_paths))}: no documents (every input is empty)")
    return docs_all, quarantine_all


def _fingerprint(input_paths: Sequence[str | Path], recipe: Recipe, shard_docs: int) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"recipe": to_dict(recipe), "shard_docs": shard_docs}, sort_keys=True).encode())
    for p in input_paths:
        h.update(str(p).encode())
    return h.hexdigest()


def _content_digest(docs: pl.DataFrame, batch: int = 10_000) -> str:
    """A digest of the documents as read (ids and texts), so edited inputs invalidate old shards.
    Hashed ``batch`` rows at a time: a whole-corpus ``to_list`` would double the texts in memory."""
    h = hashlib.sha256()
    for lo in range(0, docs.height, batch):
        part = docs.slice(lo, batch)
        for doc_id, text in zip(part["id"].to_list(), part["text"].to_list()):
            h.update(doc_id.encode())
            h.update(b"\0")
            h.update(text.encode())
            h.update(b"\1")
    return h.hexdigest()


def _segments(recipe: Recipe) -> list[tuple[bool, tuple]]:
    """Split steps into ``(is_global, steps)``: runs of per-document steps, and single global steps."""
    out: list[tuple[bool, tuple]] = []
    for s in recipe.steps:
        if s.is_global:
            out.append((True, (s,)))
        elif out and not out[-1][0]:
            out[-1] = (False, out[-1][1] + (s,))
        else:
            out.append((False, (s,)))
    return out


def _write_part(folder: Path, kept: pl.DataFrame, dropped: pl.DataFrame, info: list[dict]) -> None:
    write_parquet(folder / "kept.parquet", kept)
    write_parquet(folder / "dropped.parquet", dropped)
    write_json(folder / "steps.json", info)
    fault_point("sharded.part")
    write_text(folder / MARKER, "ok\n")  # written last: its presence means the part is complete


def _read_part(folder: Path) -> tuple[pl.DataFrame, pl.DataFrame, list[dict]]:
    return (pl.read_parquet(folder / "kept.parquet"), pl.read_parquet(folder / "dropped.parquet"),
            read_json(folder / "steps.json"))


def _run_local_shard(shard: pl.DataFrame, steps: tuple, folder: str, token_count: TokenCount) -> int:
    """Worker: apply per-document steps to one shard and write its part. Returns the rows kept."""
    kept, dropped, infos = shard, [], []
    for s in steps:
        kept, d, info = apply_step(kept, s, token_count=token_count)
        dropped.append(d)
        infos.append(info)
    _write_part(Path(folder), kept, pl.concat(dropped) if dropped else pl.DataFrame(schema=DROPPED_SCHEMA), infos)
    return kept.height


def _merge_infos(per_shard: list[list[dict]]) -> list[dict]:
    """Sum per-shard step counters into one entry per step."""
    merged: list[dict] = []
    for infos in per_shard:
        for j, info in enumerate(infos):
            if j == len(merged):
                merged.append(dict(info))
            else:
                for k, v in info.items():
                    if isinstance(v, int) and not isinstance(v, bool):
                        merged[j][k] = merged[j].get(k, 0) + v
    return merged


def curate_corpus(
    input_paths: Sequence[str | Path],
    out_dir: str | Path,
    recipe: Recipe,
    *,
    n_workers: int = 2,
    shard_docs: int = 20_000,
    executor: Executor | None = None,
    rewriter: Callable[[pl.DataFrame, str, int | None], pl.DataFrame] | None = None,
    token_count: TokenCount = whitespace_words,
    index: DedupIndex | None = None,
) -> dict:
    """Curate files into ``out_dir/{kept,dropped,quarantine}.parquet`` and ``stats.json``; return the stats.

    ``executor``: anything with ``submit`` (a Ray-backed pool, say); default a
    process pool of ``n_workers`` (spawned, so no forked polars threads), or in-process
    when ``n_workers == 1``. Worker functions must be importable by the workers.
    The returned dict is ``stats.json`` plus ``run`` (``shards_computed``,
    ``shards_reused``), which is not written, so a resumed run's files are identical.

    ``index``: a :class:`DedupIndex` of an earlier corpus; the dedup steps also drop documents
    duplicating it (see :func:`tasks.curation.recipes.apply_step`). Its fingerprint is part of
    the resume key, and ``stats.json`` records it (``dedup_index``). Ids already in the index are
    refused before anything is written: this corpus, or part of it, was added already, and
    deduplicating it against itself would drop those documents as copies of themselves.
    """
    require(n_workers > 0, "n_workers", "must be positive")
    require(shard_docs > 0, "shard_docs", "must be positive")
    if recipe.needs_rewriter and rewriter is None:
        raise ValueError("this recipe has a rewrite step: pass rewriter= (e.g. rewrite.DocumentRewriter)")
    out = Path(out_dir)
    parts = out / ".shards"

    docs, quarantine = read_inputs(input_paths)
    records_read = docs.height + quarantine.height
    docs, dup_q = drop_duplicate_ids(docs)
    quarantine = pl.concat([quarantine, dup_q])

    fingerprint = _fingerprint(input_paths, recipe, shard_docs) + ":" + _content_digest(docs)
    index_stats = None
    if index is not None and len(index):
        index.minhash_config_for([s.settings for s in recipe.steps if s.kind == "minhash"])
        index.refuse_indexed(docs["id"])
        index_stats = {"docs": len(index), "fingerprint": index.fingerprint()}
        fingerprint += ":index:" + index_stats["fingerprint"]
    manifest = parts / "manifest.json"
    if manifest.exists() and read_json(manifest).get("fingerprint") != fingerprint:
        shutil.rmtree(parts)  # inputs or recipe changed: old parts would mix two runs
    if not manifest.exists():
        write_json(manifest, {"fingerprint": fingerprint, "recipe": to_dict(recipe), "shard_docs": shard_docs,
                              "inputs": [str(p) for p in input_paths]})

    own_pool = None
    if executor is None:
        if n_workers == 1:
            executor = SerialExecutor()
        else:
            own_pool = ProcessPoolExecutor(n_workers, mp_context=multiprocessing.get_context("spawn"))
            executor = own_pool
    computed = reused = 0
    current = docs
    dropped_parts: list[pl.DataFrame] = []
    step_infos: list[dict] = []
    try:
        for k, (is_global, steps) in enumerate(_segments(recipe)):
            if is_global:
                folder = parts / f"seg{k:02d}-{steps[0].kind}"
                if (folder / MARKER).exists():
                    reused += 1
                else:
                    # MinHash signatures shard by shard through the executor, like per-document steps
                    kept, dropped, info = apply_step(current, steps[0], rewriter=rewriter, token_count=token_count,
                                                     index=index, executor=executor,
                                                     n_shards=max(1, -(-current.height // shard_docs)))
                    _write_part(folder, kept, dropped, [info])
                    computed += 1
                current, dropped, infos = _read_part(folder)
                dropped_parts.append(dropped)
                step_infos.extend(infos)
                continue
            shards = shard_frame(current, shard_docs)
            folders = [parts / f"seg{k:02d}-local" / f"shard{i:05d}" for i in range(len(shards))]
            futures = []
            for shard, folder in zip(shards, folders):
                if (folder / MARKER).exists():
                    reused += 1
                    continue
                futures.append(executor.submit(_run_local_shard, shard, steps, str(folder), token_count))
            errors = []
            for fut in futures:
                try:
                    fut.result()
                    computed += 1
                except Exception as exc:  # noqa: BLE001 — let every shard finish, then report
                    errors.append(exc)
            if errors:
                raise RuntimeError(f"{len(errors)} of {len(shards)} shards failed in segment {k}; "
                                   f"finished shards are kept under {parts} for a rerun") from errors[0]
            loaded = [_read_part(f) for f in folders]
            current = pl.concat([p[0] for p in loaded])
            dropped_parts.extend(p[1] for p in loaded)
            step_infos.extend(_merge_infos([p[2] for p in loaded]))
    finally:
        if own_pool is not None:
            own_pool.shutdown()

    kept = finalize(current)
    dropped = pl.concat(dropped_parts) if dropped_parts else pl.DataFrame(schema=DROPPED_SCHEMA)
    stats = curation_stats(docs, kept, dropped, token_count=token_count, steps=step_infos)
    stats.update(
        records_read=records_read,
        quarantined=quarantine.height,
        quarantined_by_reason=dict(sorted((r, int(c)) for r, c in quarantine.group_by("reason").len().iter_rows())),
        recipe=to_dict(recipe),
        shard_docs=shard_docs,
    )
    if index_stats is not None:
        stats["dedup_index"] = index_stats
    if records_read != stats["docs_in"] + quarantine.height:
        raise AssertionError(f"records read {records_read} != docs {stats['docs_in']} + quarantined {quarantine.height}")
    write_parquet(out / "kept.parquet", kept)
    write_parquet(out / "dropped.parquet", dropped)
    write_parquet(out / "quarantine.parquet", quarantine)
    write_json(out / "stats.json", stats)
    return {**stats, "run": {"shards_computed": computed, "shards_reused": reused}}
