"""Sharded, resumable, streaming curation of a user corpus: the engine behind ``scalelab curate``.

    scalelab curate --input data/*.jsonl --out out/curated --recipe dedup_gopher

:func:`curate_corpus` streams JSONL (plain, ``.gz``, ``.zst``) and Parquet inputs, files or globs
(bad lines quarantined with file and line), into input shards of ``shard_docs`` documents under
``out/.shards/input/``, then runs the recipe in *segments*: a run of per-document steps (heuristic
filters) is applied shard by shard in parallel, each worker reading its shard file and writing its
kept and dropped parts; a step that needs the whole corpus (``exact_dedup``, ``minhash``,
``rewrite``, ``mix``) runs once over the union of the shards, so dedup is global and its result
(which copy is kept: the lowest id), like the rewrite budget's and the mix's, is the same as a
single-process run.

Memory is bounded by the shard size, not the corpus: the main process holds at most about two
shards of documents (while reading inputs and re-cutting shards) plus small per-document data —
every id (duplicate ids are found on ids alone), and for dedup the (id, digest) pairs or, for
MinHash, one LSH band's keys at a time and the signatures of the documents in a candidate pair
(signatures and band keys are computed and saved per shard by the workers), and for ``mix`` each
document's id, whether it has a rewrite and its two token counts (computed by the workers). Each
decision is then applied shard by shard. ``rewrite`` calls the rewriter in the main process one
shard at a time, carrying the budget left from shard to shard, so the same documents are rewritten
as in one call on the whole corpus (a ``DocumentRewriter`` keeps its own results, the rewrite
cache, in memory). The final ``kept``/``dropped``/``quarantine.parquet`` are streamed together from the
part files and ``stats.json`` sums per-part counters. ``benchmarks/curation_scale.py`` measures
the peak RSS.

Every shard and every global step writes its outputs under ``out_dir/.shards/``
and then a ``DONE`` marker; a rerun after a crash reuses finished parts and
recomputes the rest, giving identical final files. ``.shards/manifest.json`` holds
a fingerprint of inputs (digested while streaming them), recipe and shard size: when it differs,
old parts are discarded rather than mixed with new ones.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import multiprocessing
import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import polars as pl

from tasks.common.config import require, to_dict
from tasks.common.faults import fault_point
from tasks.common.io import atomic_path, read_json, write_json, write_parquet, write_text
from tasks.curation.dedup import (
    DedupIndex,
    MinHashConfig,
    _band_keys,
    _duplicate_of,
    band_candidate_pairs,
    clusters_from_pairs,
    exact_digests,
    exact_duplicates_of_digests,
    id_rank,
    ids_after_index,
    jaccard_estimates,
    minhash_signatures,
)
from tasks.curation.decontam import ValDecontaminator
from tasks.curation.prepare import SourceSpec, _quarantine_rows, file_sources
from tasks.curation.recipes import (
    DROPPED_SCHEMA,
    KEPT_SCHEMA,
    FilterCache,
    Recipe,
    _as_working,
    _dropped,
    apply_mix,
    apply_step,
    decontaminate_part,
    decontamination_info,
    finalize,
    mix_decision,
    mix_keys,
    stats_from_counts,
    text_counts,
)
from tasks.curation.sources import QUARANTINE_SCHEMA, empty_docs, read_source, read_source_batches
from tasks.curation.text import TokenCount, counter_name, whitespace_words

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


Inputs = Sequence[str | Path | SourceSpec]


def check_inputs(inputs: Inputs, *, text_field: str = "text", id_field: str | None = "id") -> list[SourceSpec]:
    """Refuse unusable inputs before anything is written; return them as source specs.

    ``inputs``: files and globs (JSONL or Parquet, by extension; :func:`~tasks.curation.prepare.file_sources`
    with ``text_field``/``id_field``), or :class:`~tasks.curation.prepare.SourceSpec` s — the
    entries of ``prepare.sources``, so the pipeline's sources curate as they prepare.
    Cheap: resolves every file and glob and reads only Parquet schemas. ``ValueError`` or
    ``FileNotFoundError`` names the path: a directory, a missing or empty file, an unknown
    extension, a Parquet file without a string text column.
    """
    require(len(inputs) > 0, "input_paths", "give at least one file or glob")
    specs = [i for i in inputs if isinstance(i, SourceSpec)]
    paths = [i for i in inputs if not isinstance(i, SourceSpec)]
    if paths:
        specs += file_sources(paths, text_field=text_field, id_field=id_field)
    for spec in specs:
        spec.check()
    return specs


def read_inputs(inputs: Inputs, *, text_field: str = "text", id_field: str | None = "id"
                ) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Documents and quarantine from JSONL (``.jsonl``/``.json``/``.ndjson``) and Parquet files or globs,
    or source specs (checked first by :func:`check_inputs`), whole in memory: for small corpora and
    as a reference in tests; :func:`curate_corpus` streams them with :func:`ingest_shards` instead."""
    docs, quarantine = [], []
    for spec in check_inputs(inputs, text_field=text_field, id_field=id_field):
        d, q = read_source(spec.build())
        docs.append(d)
        quarantine.append(q)
    docs_all, quarantine_all = pl.concat(docs), pl.concat(quarantine)
    if docs_all.height == 0 and quarantine_all.height == 0:
        raise ValueError(f"{', '.join(map(str, inputs))}: no documents (every input is empty)")
    return docs_all, quarantine_all


def _fingerprint(specs: Sequence[SourceSpec], recipe: Recipe, shard_docs: int) -> str:
    h = hashlib.sha256()
    # parts: the layout of the part folders (2: a dropped file per step), so older parts are not read
    h.update(json.dumps({"recipe": to_dict(recipe), "shard_docs": shard_docs, "parts": 2}, sort_keys=True).encode())
    for spec in specs:
        h.update(json.dumps(to_dict(spec), sort_keys=True).encode())
    return h.hexdigest()


def _gather(executor: Executor, fn: Callable[..., Any], calls: Sequence[tuple]) -> list:
    """``fn(*args)`` for every ``args`` through ``executor``; results in order (the first error raised)."""
    futures = [executor.submit(fn, *args) for args in calls]
    return [f.result() for f in futures]


def _text_stats(shard: str, token_count: TokenCount) -> dict:
    """Worker: :func:`~tasks.curation.recipes.text_counts` of one shard's texts."""
    return text_counts(pl.read_parquet(shard, columns=["text"])["text"], token_count)


def ingest_shards(specs: Sequence[SourceSpec], folder: Path, shard_docs: int,
                  on_shard: Callable[[Path], None] | None = None) -> dict:
    """Stream the sources (:func:`check_inputs`) into document shards ``folder/docs-<i>.parquet``
    of ``shard_docs`` rows.

    Sources are read in order, in batches (:func:`~tasks.curation.sources.read_source_batches`); a repeated id after its first occurrence
    becomes a ``duplicate_id`` quarantine row (only the ids seen are remembered). At most about
    two shards of documents are in memory at once. ``on_shard`` is called with each shard as it
    is written (to start work on it). Returns ``shards`` (paths, at least one, possibly empty),
    ``quarantine`` (paths: quarantine as read, then duplicate ids), ``records_read``, ``docs``,
    ``ids`` (every kept id, in order) and ``digest`` (sha256 of ids and texts, the content part of
    the resume fingerprint).
    """
    folder.mkdir(parents=True, exist_ok=True)
    seen: dict[str, None] = {}  # insertion-ordered: ids in input order
    digest = hashlib.sha256()
    shards: list[Path] = []
    read_q: list[Path] = []
    dup_q: list[Path] = []
    buf: list[pl.DataFrame] = []
    buffered = records = 0

    def write_shard(frame: pl.DataFrame) -> None:
        path = write_parquet(folder / f"docs-{len(shards):05d}.parquet", frame)
        shards.append(path)
        if on_shard is not None:
            on_shard(path)

    for spec in specs:
        for docs, quarantine in read_source_batches(spec.build(), batch=min(shard_docs, 20_000)):
            records += docs.height + quarantine.height
            if quarantine.height:
                read_q.append(write_parquet(folder / f"quarantine-read-{len(read_q):05d}.parquet", quarantine))
            first = []
            for doc_id in docs["id"].to_list():
                first.append(doc_id not in seen)
                seen.setdefault(doc_id)
            if not all(first):
                mask = pl.Series(first, dtype=pl.Boolean)
                dup_q.append(write_parquet(folder / f"quarantine-dupid-{len(dup_q):05d}.parquet",
                                           _quarantine_rows(docs.filter(~mask), "duplicate_id")))
                docs = docs.filter(mask)
            for doc_id, text in zip(docs["id"].to_list(), docs["text"].to_list()):
                digest.update(doc_id.encode())
                digest.update(b"\0")
                digest.update(text.encode())
                digest.update(b"\1")
            buf.append(docs)
            buffered += docs.height
            while buffered >= shard_docs:
                whole = pl.concat(buf)
                write_shard(whole.head(shard_docs))
                buf, buffered = [whole.slice(shard_docs)], whole.height - shard_docs
    if records == 0:
        shown = ", ".join(", ".join(s.files) or s.kind for s in specs)
        raise ValueError(f"{shown}: no documents (every input is empty)")
    if buffered or not shards:
        write_shard(pl.concat(buf) if buf else empty_docs())
    return {"shards": shards, "quarantine": read_q + dup_q, "records_read": records, "docs": len(seen),
            "ids": list(seen), "digest": digest.hexdigest()}


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


def _write_part(folder: Path, kept: pl.DataFrame, dropped: Sequence[pl.DataFrame], info: list[dict]) -> None:
    """A local segment's part of one shard: kept documents and one dropped file per step
    (``dropped-<j>.parquet``), so the final dropped file lists the documents step by step, as the
    in-memory recipe does, rather than shard by shard."""
    write_parquet(folder / "kept.parquet", kept)
    for j, d in enumerate(dropped):
        write_parquet(folder / f"dropped-{j:02d}.parquet", d)
    write_json(folder / "steps.json", info)
    fault_point("sharded.part")
    write_text(folder / MARKER, "ok\n")  # written last: its presence means the part is complete


def _run_local_shard(shard: str, steps: tuple, folder: str, token_count: TokenCount,
                     filter_cache: FilterCache | None = None) -> int:
    """Worker: read one shard file, apply per-document steps and write its part. Returns the rows kept."""
    kept, dropped, infos = pl.read_parquet(shard), [], []
    for s in steps:
        kept, d, info = apply_step(kept, s, token_count=token_count, filter_cache=filter_cache)
        dropped.append(d)
        infos.append(info)
    _write_part(Path(folder), kept, dropped, infos)
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


# ---------------------------------------------------------------- global steps on per-document keys


def _exact_keys(shard: str) -> pl.DataFrame:
    """Worker: (id, digest) of one shard, what exact dedup decides on."""
    docs = pl.read_parquet(shard, columns=["id", "text"])
    return pl.DataFrame({"id": docs["id"].cast(pl.Utf8), "digest": exact_digests(docs["text"])})


def _minhash_shard(shard: str, cfg: MinHashConfig, sig_path: str, bands_path: str) -> tuple[pl.Series, np.ndarray]:
    """Worker: MinHash signatures and LSH band keys of one shard, saved as ``.npy``; returns the
    shard's ids and which documents have no shingles."""
    docs = pl.read_parquet(shard, columns=["id", "text"])
    sig = minhash_signatures(docs["text"], cfg)
    np.save(sig_path, sig)
    np.save(bands_path, _band_keys(sig, cfg))
    return docs["id"].cast(pl.Utf8), np.all(sig == np.iinfo(sig.dtype).max, axis=1)


def _load_rows(path: Path, n: int, cols: int, dtype: Any) -> np.ndarray:
    """A saved (n, cols) array memory-mapped (an empty one without a map: nothing to map)."""
    return np.load(path, mmap_mode="r") if n else np.zeros((0, cols), dtype)


def _minhash_duplicates_on_disk(files: Sequence[Path], cfg: MinHashConfig, work: Path, executor: Executor,
                                index: DedupIndex | None) -> tuple[pl.Series, pl.Series]:
    """``(ids, duplicate_of)`` of the documents in ``files``, equal to
    :func:`~tasks.curation.dedup.minhash_duplicates` over their concatenation.

    Signatures and band keys are computed per shard by the workers and saved under ``work``;
    this process holds per document only its id, rank and one band's key at a time (LSH
    buckets are found band by band), then, when ``cfg.threshold`` asks for verification, the
    signatures of the documents that are in some candidate pair, read back shard by shard.
    """
    calls = [(str(f), cfg, str(work / f"sig-{i:05d}.npy"), str(work / f"bands-{i:05d}.npy"))
             for i, f in enumerate(files)]
    per_shard = _gather(executor, _minhash_shard, calls)
    ids = pl.concat([p[0] for p in per_shard]) if per_shard else pl.Series("id", [], pl.Utf8)
    sizes = [len(p[0]) for p in per_shard]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    dtype = np.uint64 if cfg.hash_bits == 64 else np.uint32
    m = 0
    if index is not None and index.minhash_ids is not None and len(index.minhash_ids):
        index.check_config(cfg)
        m = len(index.minhash_ids)
        isig = index.minhash_sig.astype(dtype)
        ikeys = _band_keys(isig, cfg)
    else:
        isig = np.zeros((0, cfg.num_perm), dtype)
        ikeys = np.zeros((0, cfg.bands), np.uint64)
    empty = np.concatenate([np.all(isig == np.iinfo(dtype).max, axis=1), *[p[1] for p in per_shard]]).astype(bool)
    del per_shard

    def band_columns():
        for b in range(cfg.bands):
            cols = [ikeys[:, b]]
            for i, n in enumerate(sizes):
                if n:
                    cols.append(np.array(_load_rows(work / f"bands-{i:05d}.npy", n, cfg.bands, np.uint64)[:, b]))
            yield np.concatenate(cols)

    pairs = band_candidate_pairs(band_columns(), empty)
    if cfg.threshold is not None and len(pairs):
        involved = np.unique(pairs)  # sorted global document numbers (index documents first)
        rows = np.empty((len(involved), cfg.num_perm), dtype)
        lo = int(np.searchsorted(involved, m))
        rows[:lo] = isig[involved[:lo]]
        for i, n in enumerate(sizes):
            a, b = np.searchsorted(involved, [m + offsets[i], m + offsets[i + 1]])
            if a < b:
                rows[a:b] = _load_rows(work / f"sig-{i:05d}.npy", n, cfg.num_perm, dtype)[involved[a:b] - m - offsets[i]]
        pairs = pairs[jaccard_estimates(rows, np.searchsorted(involved, pairs)) >= cfg.threshold]
        del rows
    all_ids, rank = ids_after_index(index.minhash_ids, ids) if m else (ids, id_rank(ids))
    rep = clusters_from_pairs(pairs, m + len(ids), rank)
    return ids, _duplicate_of(all_ids, rep)[m:]


def _apply_duplicates(shard: str, decision: str, reason: str, kept_path: str, dropped_path: str) -> int:
    """Worker: split one shard by a decision file (``id``, ``duplicate_of`` of the dropped ones)."""
    docs = _as_working(pl.read_parquet(shard))
    dups = pl.scan_parquet(decision).filter(pl.col("id").is_in(docs["id"].implode())).collect()
    dup = docs.select("id").join(dups, on="id", how="left", maintain_order="left")["duplicate_of"]
    is_dup = dup.is_not_null()
    write_parquet(kept_path, docs.filter(~is_dup))
    write_parquet(dropped_path, _dropped(docs.filter(is_dup), reason, dup.filter(is_dup)))
    return int(is_dup.sum())


# ---------------------------------------------------------------- rewrite and mix, shard by shard


def _rewrite_shards(s: Any, files: Sequence[Path], folder: Path, work: Path, *, rewriter: Any,
                    token_count: TokenCount) -> dict:
    """The rewrite step over ``files``, one shard at a time in this process (where the generator
    lives: a loaded model or a server's client); writes ``work/kept-<i>.parquet`` and
    ``folder/dropped-<i>.parquet`` and returns the step info of the whole corpus.

    The rewriter spends its budget on new generations in document order, skipping ids it has
    settled (:class:`~tasks.curation.rewrite.DocumentRewriter`): each shard gets the budget left
    after the shards before it, so the same documents are rewritten as by one call on the
    concatenated frame. What a call spent is the rise of the rewriter's ``generated`` counter; a
    rewriter without one is taken to return only the rows it generated in that call.
    """
    cfg = s.settings
    left = cfg.budget
    infos = []
    for i, f in enumerate(files):
        before = getattr(rewriter, "generated", None)
        shard_step = dataclasses.replace(s, rewrite=dataclasses.replace(cfg, budget=left))
        kept, dropped, info = apply_step(pl.read_parquet(f), shard_step, rewriter=rewriter, token_count=token_count)
        write_parquet(work / f"kept-{i:05d}.parquet", kept)
        write_parquet(folder / f"dropped-{i:05d}.parquet", dropped)
        del kept, dropped
        infos.append(info)
        if left is not None:
            spent = rewriter.generated - before if before is not None else info["rewrite_attempted"]
            left = max(left - spent, 0)
    return _merge_rewrite_infos(infos)


def _merge_rewrite_infos(infos: Sequence[dict]) -> dict:
    """Per-shard rewrite step infos summed into the corpus's (counts, and failures by reason)."""
    merged = _merge_infos([[info] for info in infos])[0]
    failed: dict[str, int] = {}
    for info in infos:
        for reason, n in info["rewrite_failed_by_reason"].items():
            failed[reason] = failed.get(reason, 0) + n
    merged["rewrite_failed_by_reason"] = dict(sorted(failed.items()))
    return merged


def _mix_keys(shard: str, token_count: TokenCount) -> pl.DataFrame:
    """Worker: :func:`~tasks.curation.recipes.mix_keys` of one shard (id, has a rewrite, token counts)."""
    return mix_keys(_as_working(pl.read_parquet(shard)), token_count=token_count)


def _apply_mix(shard: str, decision: str, kept_path: str, dropped_path: str) -> int:
    """Worker: split one shard by a mix decision file (:func:`~tasks.curation.recipes.mix_decision`
    of the whole corpus); returns the documents dropped."""
    docs = _as_working(pl.read_parquet(shard))
    mine = pl.scan_parquet(decision).filter(pl.col("id").is_in(docs["id"].implode())).collect()
    kept, dropped = apply_mix(docs, mine)
    write_parquet(kept_path, kept)
    write_parquet(dropped_path, dropped)
    return dropped.height


def _record_batches(sources: Sequence[Path], batch_rows: int = 4_096):
    """The rows of Parquet files as Arrow record batches, in order: a few thousand rows in memory."""
    import pyarrow.parquet as pq

    for src in sources:
        yield from pq.ParquetFile(src).iter_batches(batch_size=batch_rows)


def _write_arrow(path: Path, table: Any) -> None:
    import pyarrow.parquet as pq

    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")


def _tables_of(sources: Sequence[Path], schema: Any, rows: int):
    """The rows of Parquet files ``sources``, in order, as Arrow tables of ``schema`` and ``rows``
    rows each (the last shorter; none when there are no rows): one table's rows in memory at once."""
    import pyarrow as pa

    buf, buffered = [], 0
    for batch in _record_batches(sources):
        buf.append(pa.Table.from_batches([batch]).cast(schema))
        buffered += batch.num_rows
        while buffered >= rows:
            whole = pa.concat_tables(buf)
            yield whole.slice(0, rows)
            buf, buffered = [whole.slice(rows)], whole.num_rows - rows
    if buffered:
        yield pa.concat_tables(buf)


def _rechunk(sources: Sequence[Path], folder: Path, shard_docs: int) -> int:
    """Copy the rows of ``sources`` (in order) into ``folder/kept-<j>.parquet`` of ``shard_docs``
    rows each (at least one file, possibly empty), as the next segment's shards; streams Arrow
    batches, so at most one shard is held. Returns the number of files."""
    import pyarrow.parquet as pq

    schema = pq.read_schema(sources[0])
    n_out = 0
    for table in _tables_of(sources, schema, shard_docs):
        _write_arrow(folder / f"kept-{n_out:05d}.parquet", table)
        n_out += 1
    if n_out == 0:
        _write_arrow(folder / "kept-00000.parquet", schema.empty_table())
        n_out = 1
    return n_out


def _run_global_step(s: Any, files: Sequence[Path], folder: Path, *, shard_docs: int, executor: Executor,
                     rewriter: Any, token_count: TokenCount, index: DedupIndex | None) -> None:
    """Run one global step over the shards ``files``; write ``folder/kept-<j>.parquet`` (rechunked),
    ``dropped-<i>.parquet``, ``part.json`` and the marker.

    No process holds the corpus. Dedup and ``mix`` decide on per-document keys computed by the
    workers (exact digests; MinHash band keys and signatures saved per shard; the mix's id, has a
    rewrite and token counts), once in this process, and apply the decision shard by shard.
    ``rewrite`` calls the rewriter here one shard at a time, carrying the budget left from shard
    to shard (:func:`_rewrite_shards`).
    """
    if folder.exists():
        shutil.rmtree(folder)  # an unfinished earlier try
    work = folder / "work"
    work.mkdir(parents=True)
    kind, cfg = s.kind, s.settings
    if kind in ("exact_dedup", "minhash"):
        idx = index if index is not None and len(index) else None
        info: dict[str, Any] = {"step": kind}
        if kind == "exact_dedup":
            keys = pl.concat(_gather(executor, _exact_keys, [(str(f),) for f in files]))
            ids = keys["id"]
            dup = exact_duplicates_of_digests(ids, keys["digest"], index=idx)
            del keys
            reason = "exact_dedup.duplicate"
        else:
            if idx is not None:
                idx.minhash_config_for([cfg])  # refuses an index without signatures, or of other settings
            ids, dup = _minhash_duplicates_on_disk(files, cfg, work, executor, idx)
            reason = "minhash.near_duplicate"
        if idx is not None:
            info["duplicates_of_index"] = int(dup.is_in(idx.ids.implode()).sum())
        decision = work / "duplicates.parquet"
        write_parquet(decision, pl.DataFrame({"id": ids, "duplicate_of": dup}).filter(
            pl.col("duplicate_of").is_not_null()))
        kept_parts = [work / f"kept-{i:05d}.parquet" for i in range(len(files))]
        _gather(executor, _apply_duplicates, [(str(f), str(decision), reason, str(k), str(folder / f"dropped-{i:05d}.parquet"))
                                              for i, (f, k) in enumerate(zip(files, kept_parts))])
        info.update(docs_in=len(ids), docs_out=len(ids) - int(dup.is_not_null().sum()))
        n_dropped = len(files)
    elif kind == "rewrite":
        kept_parts = [work / f"kept-{i:05d}.parquet" for i in range(len(files))]
        info = _rewrite_shards(s, files, folder, work, rewriter=rewriter, token_count=token_count)
        n_dropped = len(files)
    elif kind == "mix":
        keys = pl.concat(_gather(executor, _mix_keys, [(str(f), token_count) for f in files]))
        decision, mix_stats = mix_decision(keys, cfg)
        n_docs = keys.height
        del keys
        decision_path = write_parquet(work / "mix.parquet", decision)
        del decision
        kept_parts = [work / f"kept-{i:05d}.parquet" for i in range(len(files))]
        n_drop = sum(_gather(executor, _apply_mix, [(str(f), str(decision_path), str(k),
                                                     str(folder / f"dropped-{i:05d}.parquet"))
                                                    for i, (f, k) in enumerate(zip(files, kept_parts))]))
        info = {"step": kind, **mix_stats, "docs_in": n_docs, "docs_out": n_docs - n_drop}
        n_dropped = len(files)
    else:
        raise ValueError(f"{kind}: not a global step")
    n_kept = _rechunk(kept_parts, folder, shard_docs)
    write_json(folder / "part.json", {"kept_files": n_kept, "dropped_files": n_dropped, "steps": [info]})
    fault_point("sharded.part")
    write_text(folder / MARKER, "ok\n")
    shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------- final outputs


def _finalize_part(src: str, dst: str, token_count: TokenCount, decontaminate: ValDecontaminator | None = None,
                   dropped_dst: str | None = None) -> dict:
    """Worker: one shard of the last segment as :data:`KEPT_SCHEMA`, and its text counters.

    With ``decontaminate``, the shard's documents repeating validation text are written to
    ``dropped_dst`` instead, and ``finalized`` (documents before it) and the validation n-grams
    found before and after (``found_before``/``found_after``, bit-packed) come back too."""
    kept = finalize(pl.read_parquet(src))
    extra: dict[str, Any] = {}
    if decontaminate is not None:
        extra["finalized"] = kept.height
        kept, dropped, before, after = decontaminate_part(kept, decontaminate)
        write_parquet(dropped_dst, dropped)
        extra.update(found_before=np.packbits(before), found_after=np.packbits(after))
    write_parquet(dst, kept)
    return {**text_counts(kept["text"], token_count), "rewritten": int(kept["rewrite"].is_not_null().sum()), **extra}


def _decontamination_info(deco: ValDecontaminator, parts: Sequence[dict]) -> dict:
    """The ``val_decontamination`` step of the whole corpus from its shards' :func:`_finalize_part`."""
    n = len(deco.val_ngrams)
    before, after = np.zeros(n, bool), np.zeros(n, bool)
    for p in parts:
        before |= np.unpackbits(p["found_before"], count=n).astype(bool)
        after |= np.unpackbits(p["found_after"], count=n).astype(bool)
    return decontamination_info(deco, _sum(parts, "finalized"), _sum(parts, "docs"), before, after)


def _concat_parquet(sources: Sequence[Path], dest: Path, schema: dict) -> None:
    """``sources`` (same columns) streamed into one file, rows in order, a row group per 16,384
    rows; an empty list gives an empty file of ``schema``."""
    import pyarrow.parquet as pq

    if not sources:
        write_parquet(dest, pl.DataFrame(schema=schema))
        return
    arrow_schema = pq.read_schema(sources[0])
    with atomic_path(dest) as tmp, pq.ParquetWriter(tmp, arrow_schema, compression="zstd") as writer:
        for table in _tables_of(sources, arrow_schema, 16_384):
            writer.write_table(table)


def _count_by(sources: Sequence[Path], column: str) -> tuple[int, dict[str, int]]:
    if not sources:
        return 0, {}
    counts = pl.scan_parquet([str(p) for p in sources]).group_by(column).len().collect()
    return int(counts["len"].sum()), dict(sorted((r, int(c)) for r, c in counts.iter_rows()))


def _sum(parts: Sequence[dict], key: str) -> int:
    return sum(p[key] for p in parts)


def curate_corpus(
    inputs: Inputs,
    out_dir: str | Path,
    recipe: Recipe,
    *,
    n_workers: int = 2,
    shard_docs: int = 20_000,
    executor: Executor | None = None,
    rewriter: Callable[[pl.DataFrame, str, int | None], pl.DataFrame] | None = None,
    token_count: TokenCount = whitespace_words,
    index: DedupIndex | None = None,
    decontaminate: ValDecontaminator | None = None,
    filter_cache: FilterCache | None = None,
    text_field: str = "text",
    id_field: str | None = "id",
) -> dict:
    """Curate files into ``out_dir/{kept,dropped,quarantine}.parquet`` and ``stats.json``; return the stats.

    ``inputs``: files and globs, whose records hold their text and id under ``text_field`` and
    ``id_field``, or source specs (:func:`check_inputs`). ``token_count`` counts the
    ``tokens_in``/``tokens_kept`` of ``stats.json`` and the mix step's ratios; ``stats.json``'s
    ``token_count`` names it (:func:`~tasks.curation.text.counter_name`).

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

    ``decontaminate`` (built from a validation split) runs last, shard by shard on the final
    texts, as :func:`~tasks.curation.recipes.run_recipe` runs it: a ``val_decontamination`` step
    whose dropped documents come after the recipe's. It is not part of the resume key: the final
    shards are made again by every run. ``filter_cache`` (a
    :class:`~tasks.curation.recipes.FilterCache` shared by the recipes of one run) is used when
    the steps run in this process (``n_workers=1`` or a :class:`SerialExecutor`); a worker would
    receive a copy with every shard, so none is sent. Neither changes the result.
    """
    require(n_workers > 0, "n_workers", "must be positive")
    require(shard_docs > 0, "shard_docs", "must be positive")
    if recipe.needs_rewriter and rewriter is None:
        raise ValueError("this recipe has a rewrite step: pass rewriter= (e.g. rewrite.DocumentRewriter)")
    specs = check_inputs(inputs, text_field=text_field, id_field=id_field)
    out = Path(out_dir)
    parts = out / ".shards"
    staging = out / ".ingest"  # this run's input shards, until the manifest says where they belong

    own_pool = None
    if executor is None:
        if n_workers == 1:
            executor = SerialExecutor()
        else:
            own_pool = ProcessPoolExecutor(n_workers, mp_context=multiprocessing.get_context("spawn"))
            executor = own_pool
    shard_cache = filter_cache if isinstance(executor, SerialExecutor) else None  # not copied to workers
    computed = reused = 0
    try:
        if staging.exists():
            shutil.rmtree(staging)
        in_stats: list[Future] = []
        try:
            ingested = ingest_shards(specs, staging, shard_docs, on_shard=lambda p: in_stats.append(
                executor.submit(_text_stats, str(p), token_count)))
            fingerprint = _fingerprint(specs, recipe, shard_docs) + ":" + ingested["digest"]
            index_stats = None
            if index is not None and len(index):
                index.minhash_config_for([s.settings for s in recipe.steps if s.kind == "minhash"])
                index.refuse_indexed(pl.Series("id", ingested["ids"], pl.Utf8))
                index_stats = {"docs": len(index), "fingerprint": index.fingerprint()}
                fingerprint += ":index:" + index_stats["fingerprint"]
            del ingested["ids"]
            in_counts = [f.result() for f in in_stats]
        except BaseException:
            for f in in_stats:
                f.cancel()
            shutil.rmtree(staging, ignore_errors=True)
            raise
        manifest = parts / "manifest.json"
        if manifest.exists() and read_json(manifest).get("fingerprint") != fingerprint:
            shutil.rmtree(parts)  # inputs or recipe changed: old parts would mix two runs
        if (parts / "input").exists():
            shutil.rmtree(parts / "input")
        parts.mkdir(parents=True, exist_ok=True)
        staging.rename(parts / "input")
        if not manifest.exists():
            write_json(manifest, {"fingerprint": fingerprint, "recipe": to_dict(recipe), "shard_docs": shard_docs,
                                  "inputs": [to_dict(spec) for spec in specs]})
        files = [parts / "input" / p.name for p in ingested["shards"]]
        quarantine_files = [parts / "input" / p.name for p in ingested["quarantine"]]

        dropped_files: list[Path] = []
        step_infos: list[dict] = []
        for k, (is_global, steps) in enumerate(_segments(recipe)):
            if is_global:
                folder = parts / f"seg{k:02d}-{steps[0].kind}"
                if (folder / MARKER).exists():
                    reused += 1
                else:
                    _run_global_step(steps[0], files, folder, shard_docs=shard_docs, executor=executor,
                                     rewriter=rewriter, token_count=token_count, index=index)
                    computed += 1
                part = read_json(folder / "part.json")
                files = [folder / f"kept-{j:05d}.parquet" for j in range(part["kept_files"])]
                dropped_files += [folder / f"dropped-{j:05d}.parquet" for j in range(part["dropped_files"])]
                step_infos.extend(part["steps"])
                continue
            folders = [parts / f"seg{k:02d}-local" / f"shard{i:05d}" for i in range(len(files))]
            futures = []
            for shard, folder in zip(files, folders):
                if (folder / MARKER).exists():
                    reused += 1
                    continue
                futures.append(executor.submit(_run_local_shard, str(shard), steps, str(folder), token_count,
                                               shard_cache))
            errors = []
            for fut in futures:
                try:
                    fut.result()
                    computed += 1
                except Exception as exc:  # noqa: BLE001 — let every shard finish, then report
                    errors.append(exc)
            if errors:
                raise RuntimeError(f"{len(errors)} of {len(files)} shards failed in segment {k}; "
                                   f"finished shards are kept under {parts} for a rerun") from errors[0]
            files = [f / "kept.parquet" for f in folders]
            dropped_files += [f / f"dropped-{j:02d}.parquet" for j in range(len(steps)) for f in folders]
            step_infos.extend(_merge_infos([read_json(f / "steps.json") for f in folders]))

        final = parts / "final"
        if final.exists():
            shutil.rmtree(final)
        final.mkdir()
        finals = [final / f"kept-{i:05d}.parquet" for i in range(len(files))]
        deco_dropped = [final / f"dropped-{i:05d}.parquet" for i in range(len(files))] if decontaminate else []
        out_counts = _gather(executor, _finalize_part, [(str(f), str(d), token_count, decontaminate,
                                                         str(deco_dropped[i]) if decontaminate else None)
                                                        for i, (f, d) in enumerate(zip(files, finals))])
        if decontaminate is not None:
            step_infos.append(_decontamination_info(decontaminate, out_counts))
            dropped_files += deco_dropped
    finally:
        if own_pool is not None:
            own_pool.shutdown()

    _, by_reason = _count_by(dropped_files, "reason")
    n_quarantined, quarantined_by_reason = _count_by(quarantine_files, "reason")
    records_read = ingested["records_read"]
    counts_in, counts_kept = ({k: _sum(c, k) for k in ("docs", "words", "tokens")} for c in (in_counts, out_counts))
    stats = stats_from_counts(counts_in, counts_kept, dropped_by_reason=by_reason,
                              docs_rewritten=_sum(out_counts, "rewritten"), steps=step_infos,
                              token_count=counter_name(token_count))
    stats.update(records_read=records_read, quarantined=n_quarantined, quarantined_by_reason=quarantined_by_reason,
                 recipe=to_dict(recipe), shard_docs=shard_docs)
    if index_stats is not None:
        stats["dedup_index"] = index_stats
    if records_read != stats["docs_in"] + n_quarantined:
        raise AssertionError(f"records read {records_read} != docs {stats['docs_in']} + quarantined {n_quarantined}")
    _concat_parquet(finals, out / "kept.parquet", KEPT_SCHEMA)
    _concat_parquet(dropped_files, out / "dropped.parquet", DROPPED_SCHEMA)
    _concat_parquet(quarantine_files, out / "quarantine.parquet", QUARANTINE_SCHEMA)
    shutil.rmtree(final)
    write_json(out / "stats.json", stats)
    return {**stats, "run": {"shards_computed": computed, "shards_reused": reused}}
