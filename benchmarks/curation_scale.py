"""Peak memory and throughput of the sharded curation engine (``scalelab curate``) on a synthetic corpus.

Run: .venv/bin/python benchmarks/curation_scale.py --gb 0.5 [--format jsonl.gz|jsonl.zst|jsonl|parquet]
     [--workers 2] [--shard-docs 20000] [--steps exact_dedup,minhash] [--json out.json]

Writes a synthetic corpus once (cached under --data, default /tmp/scalelab_scale/<size>-<format>):
~2 KB English-like documents (a Zipf draw over stop words and a made-up vocabulary), 5% exact
copies (case and spacing changed) and 5% near copies (a few words replaced), spread over files of
--file-mb each. Then runs ``curate_corpus`` on a glob of those files in a fresh process, sampling
the resident memory of that process and its workers (summed) every 0.2 s, and reports peak RSS,
docs/s and MB/s of input text. The corpus is generated outside the timed and sampled run.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STOP = ("the of and to in a is that for it as was with be by on not he this are or his from at which but "
        "have an they you were her she there been one all we their has would when if so no will can more "
        "its who about some them out into than then also what like other could time").split()


def _vocabulary(n: int, seed: int) -> list[str]:
    import numpy as np

    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghiklmnoprstuvwy"))
    lens = rng.integers(3, 10, size=n)
    return [("".join(rng.choice(letters, size=k))) for k in lens]


def write_corpus(folder: Path, gb: float, fmt: str, file_mb: int, seed: int = 0) -> dict:
    """Files ``part-00000.<fmt>`` ... holding about ``gb`` GB of document text; returns a summary
    (also written to ``folder/corpus.json``, whose presence means the corpus is complete)."""
    import numpy as np
    import polars as pl

    summary_path = folder / "corpus.json"
    if summary_path.exists():
        return json.loads(summary_path.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    vocab = STOP + _vocabulary(20_000, seed)
    # Zipf-like word frequencies: stop words common, the made-up vocabulary's tail rare
    weights = 1.0 / np.arange(1, len(vocab) + 1) ** 1.05
    weights /= weights.sum()
    target = int(gb * 1e9)
    written = docs = file_no = 0
    recent: list[str] = []
    while written < target:
        rows, size = [], 0
        while size < file_mb * 1e6 and written + size < target:
            kind = rng.random()
            if kind < 0.05 and recent:
                text = recent[int(rng.integers(len(recent)))].upper().replace(" ", "  ")  # exact copy
            elif kind < 0.10 and recent:
                w = recent[int(rng.integers(len(recent)))].split(" ")
                for j in rng.integers(0, len(w), size=3):
                    w[j] = "edited"
                text = " ".join(w)  # near copy
            else:
                n = int(rng.integers(250, 450))
                idx = rng.choice(len(vocab), size=n, p=weights)
                words = [vocab[i] for i in idx]
                for j in range(14, n, int(rng.integers(12, 20))):  # sentences
                    words[j] += "."
                words[0] = words[0].capitalize()
                text = " ".join(words) + "."
                recent.append(text)
                if len(recent) > 2_000:
                    recent = recent[-1_000:]
            rows.append({"id": f"d{docs:09d}", "text": text})
            docs += 1
            size += len(text)
        path = folder / f"part-{file_no:05d}.{fmt}"
        if fmt == "parquet":
            pl.DataFrame(rows).write_parquet(path)
        else:
            payload = "".join(json.dumps(r) + "\n" for r in rows).encode()
            if fmt == "jsonl.gz":
                payload = gzip.compress(payload, compresslevel=1)
            elif fmt == "jsonl.zst":
                import zstandard

                payload = zstandard.ZstdCompressor(level=3).compress(payload)
            path.write_bytes(payload)
        written += size
        file_no += 1
    summary = {"docs": docs, "text_bytes": written, "files": file_no, "format": fmt,
               "disk_bytes": sum(p.stat().st_size for p in folder.glob(f"part-*.{fmt}"))}
    summary_path.write_text(json.dumps(summary))
    return summary


def _run_curation(args: argparse.Namespace) -> None:
    """Child process: curate the corpus and print the stats as one JSON line."""
    from tasks.curation.recipes import Recipe, step
    from tasks.curation.sharded import curate_corpus

    recipe = Recipe(steps=tuple(step(s) for s in args.steps.split(",")))
    t0 = time.perf_counter()
    stats = curate_corpus([str(args.data / f"part-*.{args.format}")], args.out, recipe, n_workers=args.workers,
                          shard_docs=args.shard_docs)
    print(json.dumps({"seconds": time.perf_counter() - t0, "docs_in": stats["docs_in"],
                      "docs_kept": stats["docs_kept"], "dropped_by_reason": stats["dropped_by_reason"]}))


def _tree_rss(proc) -> int:
    import psutil

    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=0.5, help="GB of document text to generate")
    ap.add_argument("--format", choices=("jsonl.gz", "jsonl.zst", "jsonl", "parquet"), default="jsonl.gz")
    ap.add_argument("--file-mb", type=int, default=64, help="MB of text per input file")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--shard-docs", type=int, default=20_000)
    ap.add_argument("--steps", default="exact_dedup,minhash", help="comma-separated recipe steps (defaults)")
    ap.add_argument("--data", type=Path, help="corpus folder (default /tmp/scalelab_scale/<gb>gb-<format>)")
    ap.add_argument("--out", type=Path, help="curation output folder (default: <data>-out, replaced)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--run-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.data = args.data or Path(f"/tmp/scalelab_scale/{args.gb:g}gb-{args.format}")
    args.out = args.out or args.data.with_name(args.data.name + "-out")
    if args.run_only:
        _run_curation(args)
        return 0
    import psutil

    t0 = time.perf_counter()
    corpus = write_corpus(args.data, args.gb, args.format, args.file_mb)
    print(f"corpus: {corpus['docs']} docs, {corpus['text_bytes'] / 1e9:.2f} GB text, {corpus['files']} "
          f"{args.format} files ({corpus['disk_bytes'] / 1e9:.2f} GB on disk) in {args.data} "
          f"[{time.perf_counter() - t0:.0f} s]")
    if args.out.exists():
        import shutil

        shutil.rmtree(args.out)
    cmd = [sys.executable, __file__, "--run-only", "--gb", str(args.gb), "--format", args.format,
           "--workers", str(args.workers), "--shard-docs", str(args.shard_docs), "--steps", args.steps,
           "--data", str(args.data), "--out", str(args.out)]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    proc, peak, main_peak = psutil.Process(child.pid), 0, 0
    while child.poll() is None:
        try:
            peak = max(peak, _tree_rss(proc))
            main_peak = max(main_peak, proc.memory_info().rss)
        except psutil.Error:
            pass
        time.sleep(0.2)
    out = child.stdout.read()
    if child.returncode != 0:
        print(out)
        return child.returncode
    res = json.loads(out.strip().splitlines()[-1])
    rate = res["docs_in"] / res["seconds"]
    report = {**corpus, **res, "workers": args.workers, "shard_docs": args.shard_docs, "steps": args.steps,
              "docs_per_s": rate, "text_mb_per_s": corpus["text_bytes"] / 1e6 / res["seconds"],
              "peak_rss_gb": peak / 1e9, "peak_rss_main_gb": main_peak / 1e9}
    print(f"curate [{args.steps}], {args.workers} workers, shard_docs {args.shard_docs}: {res['seconds']:.0f} s, "
          f"{rate:.0f} docs/s, {report['text_mb_per_s']:.2f} MB/s of text; kept {res['docs_kept']} of "
          f"{res['docs_in']} ({res['dropped_by_reason']})")
    print(f"peak RSS {peak / 1e9:.2f} GB (main process and workers summed; main alone {main_peak / 1e9:.2f} GB) "
          f"for {corpus['text_bytes'] / 1e9:.2f} GB of text")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
