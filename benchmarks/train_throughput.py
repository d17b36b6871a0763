"""Training throughput: scalelab's train loop vs a bare PyTorch loop on the same model and batch.

Run: ``.venv/bin/python benchmarks/train_throughput.py [--steps 20 --repeats 3 --threads 1]``

Both loops train the same Llama rung (fresh init per repeat, same seed) for the same steps with
the same AdamW settings, clipping and batch shape; scalelab's time is its TrainResult.tokens_per_s
(training steps only, as the bare loop). Prints the median tokens/s of each and the ratio
(goal >= 0.95), then what fused AdamW, SDPA vs eager attention and torch.compile change in the
bare loop on this machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.training.config import TrainingConfig  # noqa: E402
from tasks.lm.model import ModelShape  # noqa: E402
from tasks.training.loop import WindowSampler, train_model  # noqa: E402
from tasks.training.design import ladder  # noqa: E402
from tasks.lm.model import build_model  # noqa: E402


def bare_loop(cfg: TrainingConfig, tokens: np.ndarray, steps: int, *, fused: bool | None = None,
              attn: str = "sdpa", compile_model: bool = False) -> float:
    """tokens/s of a plain loop: random windows, forward, CE, backward, clip, AdamW."""
    shape = cfg.sizes[0]
    model = build_model(shape, cfg.vocab_size, cfg.seq_len, seed=cfg.seed)
    model.config._attn_implementation = attn
    model.train()
    fwd = torch.compile(model) if compile_model else model
    kw = {"fused": True} if fused else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, **kw)
    data = torch.from_numpy(tokens.astype(np.int64))
    gen = torch.Generator().manual_seed(0)
    b, t = cfg.batch_size, cfg.seq_len

    def step():
        starts = torch.randint(0, len(data) - t - 1, (b,), generator=gen)
        rows = torch.stack([data[s : s + t + 1] for s in starts.tolist()])
        logits = fwd(input_ids=rows[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up (compilation, allocator) outside the timing, as scalelab's first step is not
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * b * t / (time.perf_counter() - t0)


def scalelab_loop(cfg: TrainingConfig, tokens: np.ndarray, steps: int) -> float:
    spec = ladder(cfg)[0]
    spec = dataclasses.replace(spec, steps=steps)
    with tempfile.TemporaryDirectory() as d:
        result = train_model(spec, cfg, tokens[:-20_000], tokens[-20_000:], Path(d), device="cpu")
    return result.tokens_per_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = TrainingConfig(
        vocab_size=2048, seq_len=128, sizes=(ModelShape(d_model=64, n_layers=2, n_heads=4),),
        token_budgets=(args.steps * 16 * 128,), batch_size=16, eval_interval=10**9, eval_tokens=2048,
        log_interval=10, checkpoint_interval=0, num_threads=args.threads,
    )
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, 400_000).astype(np.uint16)
    print(f"torch {torch.__version__}, {args.threads} thread(s), d64 l2, vocab 2048, batch 16 x 128, "
          f"{args.steps} steps, median of {args.repeats}")

    ours, bare = [], []
    for _ in range(args.repeats):  # interleaved so load changes on a shared machine hit both
        ours.append(scalelab_loop(cfg, tokens, args.steps))
        bare.append(bare_loop(cfg, tokens, args.steps))
    mo, mb = statistics.median(ours), statistics.median(bare)
    print(f"scalelab train_model : {mo:10.0f} tokens/s  (runs: {', '.join(f'{x:.0f}' for x in ours)})")
    print(f"bare PyTorch loop    : {mb:10.0f} tokens/s  (runs: {', '.join(f'{x:.0f}' for x in bare)})")
    print(f"ratio scalelab/bare  : {mo / mb:10.3f}  (goal >= 0.95)")

    def variant(label: str, **kw) -> None:
        try:
            vals = [bare_loop(cfg, tokens, args.steps, **kw) for _ in range(args.repeats)]
            v = statistics.median(vals)
            print(f"bare + {label:<22}: {v:10.0f} tokens/s  ({v / mb:.2f}x the bare foreach/SDPA loop)")
        except Exception as exc:  # report what is unavailable here instead of failing the benchmark
            print(f"bare + {label:<22}: unavailable here ({type(exc).__name__}: {str(exc).splitlines()[0][:100]})")

    variant("fused AdamW", fused=True)
    variant("eager attention", attn="eager")
    if "--no-compile" not in sys.argv:
        variant("torch.compile", compile_model=True)


if __name__ == "__main__":
    main()
