"""`scalelab curate` counting tokens with a BPE tokenizer (before) against counting words (after).

Run: nice -n 5 .venv/bin/python benchmarks/curate_token_count.py [--docs 5000] [--repeats 3]
     [--vocab 512] [--workers 2]

Issue 35: `scalelab curate` used to count the stats' tokens with whatever tokenizer lay in the
root's data/tokenizer/ (after `make demo`, the demo's 512-symbol BPE). Now the counter is
`curation.token_count` / `--token-count`, `words` by default. This runs the same command,
`scalelab curate --recipe exact_dedup` on a synthetic corpus (benchmarks/curation_scale.py's
generator: ~2 KB English-like documents, 5% exact and 5% near copies), both ways side by side —
`--token-count tokenizer:<a 512-symbol BPE trained as the train stage trains it>` and
`--token-count words` — alternating, each in a fresh process and a fresh output folder, and prints
the median wall time of each and their ratio. The corpus and tokenizer are made outside the timing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.curation_scale import write_corpus  # noqa: E402  (after the path insert)


def make_tokenizer(corpus: Path, out: Path, vocab: int) -> Path:
    """A byte-level BPE of ``vocab`` symbols trained on the corpus's first file, as the train stage
    trains the pipeline's (tasks.training.tokenizer.train_tokenizer)."""
    import polars as pl

    from tasks.training.tokenizer import train_tokenizer

    first = sorted(corpus.glob("part-*.jsonl"))[0]
    texts = pl.read_ndjson(first)["text"].head(2_000).to_list()
    out.parent.mkdir(parents=True, exist_ok=True)
    train_tokenizer(texts, vocab).save(str(out))
    return out


def run_curate(corpus: Path, out: Path, counter: str, workers: int) -> tuple[float, dict]:
    """Wall seconds of one `scalelab curate` process (start-up included) and its stats.json."""
    cmd = [sys.executable, "-m", "flows.cli", "curate", "--input", str(corpus / "part-*.jsonl"), "--out", str(out),
           "--recipe", "exact_dedup", "--workers", str(workers), "--token-count", counter]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    seconds = time.perf_counter() - t0
    return seconds, json.loads((out / "stats.json").read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=5_000, help="documents to generate (about 2 KB each)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=512, help="BPE symbols of the 'before' tokenizer (the demo's: 512)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--data", type=Path, help="corpus folder (default /tmp/scalelab_tokencount/<docs>)")
    args = ap.parse_args()

    data = args.data or Path(tempfile.gettempdir()) / "scalelab_tokencount" / str(args.docs)
    corpus = write_corpus(data, gb=args.docs * 2_000 / 1e9, fmt="jsonl", file_mb=32)
    tok = data / "tokenizer" / "tokenizer.json"
    if not tok.exists():
        make_tokenizer(data, tok, args.vocab)
    counters = {"tokenizer": f"tokenizer:{tok}", "words": "words"}
    times: dict[str, list[float]] = {k: [] for k in counters}
    stats: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for name, counter in counters.items():  # alternating, so load from other jobs hits both
                seconds, stats[name] = run_curate(data, Path(tmp) / f"{name}-{r}", counter, args.workers)
                times[name].append(seconds)
    print(f"corpus: {corpus['docs']:,} documents, {corpus['text_bytes'] / 1e6:.1f} MB of text; recipe exact_dedup; "
          f"{args.workers} workers; {args.repeats} runs each, alternating")
    for name in counters:
        s = stats[name]
        print(f"  {name:>9}: median {statistics.median(times[name]):6.1f} s  (runs: "
              f"{', '.join(f'{t:.1f}' for t in times[name])})  kept {s['docs_kept']:,} docs, "
              f"{s['tokens_kept']:,} tokens by {s['token_count']}")
    ratio = statistics.median(times["tokenizer"]) / statistics.median(times["words"])
    print(f"tokenizer / words: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
