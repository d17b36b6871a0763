"""Needle retrieval under sparse prefill and activation sparsity: SmolLM2-135M, dense against each method.

Run: ``.venv/bin/python benchmarks/sparse_retrieval.py [--lengths 1024 2048] [--depths 0.1 0.3 0.5 0.7 0.9]
[--items 2] [--distractors 99] [--sparsity 0.88] [--threads 2] [--out reports/bench]``

Items come from :func:`tasks.sparse.retrieval.build_retrieval_set` on the embedded corpus's
validation text (the ``demo`` preset of params/prepare.yaml) in SmolLM2's tokenizer: a five-digit
code planted at each depth of a haystack of each length, ranked against ``--distractors`` other
codes by log-likelihood (chance ``1 / (distractors + 1)``). Every method scores the same items:

* dense;
* QuoKA (chunks of 128 queries, floor of 8 earlier keys) and ProxyAttn (blocks of 16) at
  ``--sparsity`` of the causal KV pairs skipped in prefill (0.88 = the QuoKA paper's 12% budget);
  the candidates are scored with exact attention from the sparse prefill's cache;
* TEAL at ``--teal-sparsity`` (top-k on every MLP input), sparse in prefill and in the answer.

Prints accuracy and the mean margin (true code's log-likelihood minus the best distractor's, nats)
per method and length, and the achieved sparsity; writes ``<out>/sparse_retrieval.csv`` (one row
per item and method). A method that loses the needle shows as accuracy below dense at equal items.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import polars as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.zoo.models import load_causal_lm  # noqa: E402
from tasks.common.params import load_stage_config  # noqa: E402
from tasks.curation.prepare import PrepareConfig, prepare_corpus  # noqa: E402
from tasks.sparse.proxyattn import ProxyAttnConfig  # noqa: E402
from tasks.sparse.quoka import QuokaConfig  # noqa: E402
from tasks.sparse.registry import sparsify  # noqa: E402
from tasks.sparse.retrieval import RetrievalConfig, build_retrieval_set, score_retrieval  # noqa: E402
from tasks.sparse.teal import TealConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    p.add_argument("--items", type=int, default=2, help="items per (length, depth)")
    p.add_argument("--distractors", type=int, default=99)
    p.add_argument("--sparsity", type=float, default=0.88, help="share of causal KV pairs skipped (QuoKA, ProxyAttn)")
    p.add_argument("--teal-sparsity", type=float, default=0.5)
    p.add_argument("--methods", nargs="+", default=["dense", "quoka", "proxyattn", "teal"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "reports" / "bench"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    model, tok, _ = load_causal_lm("smollm2")
    corpus = prepare_corpus(load_stage_config(PrepareConfig, ROOT, "prepare", "demo"))
    cfg = RetrievalConfig(lengths=tuple(args.lengths), depths=tuple(args.depths), items_per_depth=args.items,
                          n_distractors=args.distractors)
    items = build_retrieval_set(tok, corpus.val["text"].to_list(), cfg)
    print(f"{len(items)} items, lengths {args.lengths}, depths {args.depths}, chance {1 / (args.distractors + 1):.3f}",
          flush=True)
    methods = {
        "dense": None,
        "quoka": lambda: sparsify(model, QuokaConfig(chunk_size=128, min_keys=8), sparsity=args.sparsity),
        "proxyattn": lambda: sparsify(model, ProxyAttnConfig(block_size=16), sparsity=args.sparsity),
        "teal": lambda: sparsify(model, TealConfig(mode="topk"), sparsity=args.teal_sparsity),
    }
    frames = []
    for name in args.methods:
        t = time.perf_counter()
        handle = methods[name]() if methods[name] else None
        scores = score_retrieval(model, items, handle=handle)
        achieved = handle.achieved_sparsity() if handle is not None else 0.0
        frames.append(scores.with_columns(method=pl.lit(name), achieved_sparsity=pl.lit(achieved)))
        print(f"{name}: accuracy {scores['correct'].mean():.3f}, mean margin {scores['margin'].mean():.2f} nats, "
              f"achieved sparsity {achieved or 0:.3f} ({time.perf_counter() - t:.0f} s)", flush=True)
    table = pl.concat(frames)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table.write_csv(out / "sparse_retrieval.csv")
    summary = table.group_by("method", "context_tokens", maintain_order=True).agg(
        accuracy=pl.col("correct").mean(), margin=pl.col("margin").mean(), items=pl.len(),
        achieved_sparsity=pl.col("achieved_sparsity").first())
    print("\n| method | tokens | items | accuracy | mean margin (nats) | achieved sparsity |\n|---|---|---|---|---|---|")
    for r in summary.iter_rows(named=True):
        print(f"| {r['method']} | {r['context_tokens']} | {r['items']} | {r['accuracy']:.2f} | {r['margin']:.2f} | "
              f"{r['achieved_sparsity'] or 0:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
