"""Sparse prefill attention quality on SmolLM2-135M: perplexity at a 12% KV budget, dense beside it.

Run: ``.venv/bin/python benchmarks/sparse_attention_quality.py [--window 4096] [--eval-tokens 8192]
[--sparsity 0.88] [--settings NAME ...] [--threads 2] [--out reports/bench]``

Every setting scores the same held-out news text (the prepared validation split of the ``demo``
preset, as in benchmarks/quant_quality.py) in windows of ``--window`` tokens: dense attention, QuoKA
(chunks of 128 and of 512, floor of 8 earlier keys; with chunks of 128 also 16, 64 and all 128 of
the chunk's queries as probes instead of the default 4) and ProxyAttn (blocks of 16; blocks of 64; blocks of 64 with
the proxy scored from each block's last 16 queries, the setting benchmarks/sparse_speed.py times
fastest) at ``--sparsity`` of the causal KV pairs skipped. Prints perplexity, its rise over dense and
the achieved sparsity, and checks issue 10's goal (perplexity up by <= 2% at a 12% budget). Writes
``<out>/sparse_attention_quality.csv``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import polars as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quant_quality import model_and_text  # noqa: E402

from tasks.lm.loss import evaluate_loss  # noqa: E402
from tasks.sparse.proxyattn import ProxyAttnConfig  # noqa: E402
from tasks.sparse.quoka import QuokaConfig  # noqa: E402
from tasks.sparse.registry import sparsify  # noqa: E402

GOAL = 0.02  # perplexity up by at most 2%

SETTINGS = {
    "QuoKA (chunk 128)": QuokaConfig(chunk_size=128, min_keys=8),
    "QuoKA (chunk 512)": QuokaConfig(chunk_size=512, min_keys=8),
    "QuoKA (chunk 128, n_queries 16)": QuokaConfig(chunk_size=128, min_keys=8, n_queries=16),
    "QuoKA (chunk 128, n_queries 64)": QuokaConfig(chunk_size=128, min_keys=8, n_queries=64),
    "QuoKA (chunk 128, n_queries 128)": QuokaConfig(chunk_size=128, min_keys=8, n_queries=128),
    "ProxyAttn (block 16)": ProxyAttnConfig(block_size=16),
    "ProxyAttn (block 64)": ProxyAttnConfig(block_size=64),
    "ProxyAttn (block 64, proxy_queries 16)": ProxyAttnConfig(block_size=64, proxy_queries=16),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--eval-tokens", type=int, default=8192)
    p.add_argument("--sparsity", type=float, default=0.88)
    p.add_argument("--settings", nargs="+", choices=sorted(SETTINGS), metavar="NAME", default=list(SETTINGS),
                   help="which settings beside dense (default: all of them)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="reports/bench")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, val, _, _, _ = model_and_text("smollm2", args.eval_tokens, 0)
    t = time.perf_counter()
    dense = evaluate_loss(model, val, args.window, 1, max_tokens=args.eval_tokens)
    rows = [{"setting": "dense", "window": args.window, "ppl": math.exp(dense), "ppl_rise": 0.0,
             "achieved_sparsity": 0.0, "seconds": time.perf_counter() - t}]
    print(f"dense: ppl {math.exp(dense):.3f} ({rows[0]['seconds']:.0f} s)", flush=True)
    for name in args.settings:
        cfg = SETTINGS[name]
        t = time.perf_counter()
        with sparsify(model, cfg, sparsity=args.sparsity) as handle:
            loss = evaluate_loss(model, val, args.window, 1, max_tokens=args.eval_tokens)
        rows.append({"setting": name, "window": args.window, "ppl": math.exp(loss),
                     "ppl_rise": math.exp(loss - dense) - 1, "achieved_sparsity": handle.achieved_sparsity(),
                     "seconds": time.perf_counter() - t})
        r = rows[-1]
        print(f"{name}: ppl {r['ppl']:.3f} ({r['ppl_rise']:+.1%}), achieved {r['achieved_sparsity']:.3f} "
              f"({r['seconds']:.0f} s)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pl.DataFrame(rows).write_csv(out / "sparse_attention_quality.csv")
    print(f"\n| setting ({args.window}-token windows, {args.eval_tokens} tokens) | perplexity | rise | achieved sparsity |"
          "\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['setting']} | {r['ppl']:.2f} | {r['ppl_rise']:+.1%} | {r['achieved_sparsity']:.3f} |")
    print()
    for r in rows[1:]:
        print(f"{'PASS' if r['ppl_rise'] <= GOAL else 'FAIL'} {r['setting']}: perplexity {r['ppl_rise']:+.1%} "
              f"(goal <= +{GOAL:.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
