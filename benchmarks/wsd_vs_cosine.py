"""WSD cooldown branches vs per-run cosine on the same (N, D) points, side by side in one run.

Run: ``.venv/bin/python benchmarks/wsd_vs_cosine.py [--budgets 262144,524288,1048576] [--widths 16,32]``

Both schedules train every (size, budget) point on the embedded corpus (demo prepare settings,
BPE vocab 512, seq_len 128, batch 32, the demo's lr rule). Cosine trains each point from scratch
(sum of D per size); WSD trains one stable run per size and a 20% cooldown branch per budget
(about max(D) * (1 + 0.2) per size). Prints each point's final validation loss under both, their
relative difference, and the tokens and FLOPs each schedule spent.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tasks.common.params import load_stage_config  # noqa: E402
from tasks.curation.prepare import PrepareConfig, prepare_corpus  # noqa: E402
from tasks.training.config import TrainingConfig  # noqa: E402
from tasks.lm.model import ModelShape  # noqa: E402
from tasks.training.design import ladder  # noqa: E402
from tasks.common.parallel import set_process_threads  # noqa: E402
from tasks.training.loop import train_model, train_size_wsd  # noqa: E402
from tasks.training.tokenizer import encode_corpus, train_tokenizer  # noqa: E402

SHAPES = {8: (1, 2), 16: (1, 2), 32: (2, 2), 48: (2, 4), 64: (3, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="262144,524288,1048576", help="token budgets D per size")
    ap.add_argument("--widths", default="16,32", help=f"d_model of each size, from {sorted(SHAPES)}")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    set_process_threads(args.threads)
    prep = prepare_corpus(load_stage_config(PrepareConfig, ROOT, "prepare", "demo"))
    tok = train_tokenizer(prep.train["text"], 512)
    train, val = encode_corpus(tok, prep.train["text"]), encode_corpus(tok, prep.val["text"])
    sizes = tuple(ModelShape(d_model=d, n_layers=SHAPES[d][0], n_heads=SHAPES[d][1])
                  for d in (int(w) for w in args.widths.split(",")))
    base = TrainingConfig(vocab_size=512, seq_len=128, sizes=sizes,
                          token_budgets=tuple(int(b) for b in args.budgets.split(",")), batch_size=32,
                          lr=1.2e-2, lr_ref_width=16, lr_width_exponent=1.0, warmup_steps=10,
                          eval_interval=10**6, eval_tokens=32768, log_interval=10**6, checkpoint_interval=0)
    wsd = dataclasses.replace(base, schedule="wsd")
    cos = dataclasses.replace(base, schedule="cosine", warmup_steps=None)
    rows, spent = {}, {"wsd": [0, 0.0, 0.0], "cosine": [0, 0.0, 0.0]}
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            specs = [s for s in ladder(wsd) if s.size == size.tag]
            t = time.perf_counter()
            res = train_size_wsd(specs, wsd, train, val, [f"{tmp}/wsd/{s.name}" for s in specs], f"{tmp}/wsd/stable-{size.tag}")
            spent["wsd"][2] += time.perf_counter() - t
            longest = max(specs, key=lambda s: s.steps)
            tokens = (longest.decay_start + sum(s.steps - s.decay_start for s in specs)) * longest.tokens_per_step
            spent["wsd"][0] += tokens
            spent["wsd"][1] += tokens * longest.flops_per_token
            for s, r in zip(specs, res):
                rows.setdefault(s.name, {})["wsd"] = r.val_loss
            for s in (s for s in ladder(cos) if s.size == size.tag):
                t = time.perf_counter()
                r = train_model(s, cos, train, val, f"{tmp}/cos/{s.name}")
                spent["cosine"][2] += time.perf_counter() - t
                spent["cosine"][0] += s.tokens_trained
                spent["cosine"][1] += s.tokens_trained * s.flops_per_token
                rows.setdefault(s.name, {})["cosine"] = r.val_loss
    print(f"{'point':<22}{'cosine':>10}{'wsd':>10}{'wsd/cos-1':>11}")
    for name, r in rows.items():
        print(f"{name:<22}{r['cosine']:>10.4f}{r['wsd']:>10.4f}{r['wsd'] / r['cosine'] - 1:>+11.2%}")
    for k, (tokens, flops, wall) in spent.items():
        print(f"{k:<8} tokens {tokens:>12,}  FLOPs {flops:.3g}  wall {wall:.0f} s")
    print(f"WSD spent {spent['wsd'][1] / spent['cosine'][1]:.2f}x cosine's FLOPs "
          f"({spent['wsd'][2] / spent['cosine'][2]:.2f}x its wall time)")


if __name__ == "__main__":
    main()
