"""Training throughput of one ladder point on 1 vs 2 workers (DDP over gloo), side by side in one run.

Run: ``/path/to/python benchmarks/train_workers.py [--preset demo] [--steps 40] [--parallel ddp]``

The point is the preset's largest rung (``params/training.yaml``; demo: d64_l3, vocab 512,
seq_len 128) at the preset's global batch (demo: 32 sequences), cut into 2 micro-batches so both
worker counts read the same samples: W = 1 runs them in one process (grad_accum 2), W = 2 gives
each worker one (:mod:`tasks.training.distributed`). Each configuration trains ``--steps`` steps
on random tokens; tokens/s is the loop's own ``TrainResult.tokens_per_s`` (training steps only,
the first timed segment left out). W = 1 is timed with 1 thread (what each of the W = 2 workers
gets) and with as many threads as W = 2 uses in all; prints the ratios and the final losses
(equal up to float summation order, or the comparison is void).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tasks.common.params import load_stage_config  # noqa: E402
from tasks.training.config import TrainingConfig  # noqa: E402
from tasks.training.distributed import PointJob, train_points  # noqa: E402
from tasks.training.design import ladder  # noqa: E402
from tasks.training.tokenizer import save_tokens  # noqa: E402


def point_config(preset: str, steps: int, workers: int, parallel: str) -> TrainingConfig:
    base = load_stage_config(TrainingConfig, ROOT, "training", preset)
    largest = max(base.sizes, key=lambda s: (s.d_model, s.n_layers))
    global_batch = base.batch_size * base.grad_accum
    if global_batch % 2:
        raise SystemExit(f"training.batch_size x grad_accum of preset {preset} is {global_batch}, odd: "
                         "no 2-worker split of the same global batch")
    return dataclasses.replace(
        base, sizes=(largest,), compute_budgets=(), token_budgets=(steps * global_batch * base.seq_len,),
        schedule="cosine", batch_size=global_batch // 2, grad_accum=2, eval_interval=10 * steps,
        eval_tokens=4 * base.seq_len + 1, log_interval=max(1, steps // 8), checkpoint_interval=0, seeds=(),
        seed_sizes=(), extra_branches=(), arch_compare=(), num_threads=1, compile=False,
        workers_per_point=workers, parallel=parallel)


def measure(cfg: TrainingConfig, files: tuple[str, str], out: Path, threads: int):
    torch.set_num_threads(threads)  # the W = 1 run trains in this process; workers set their own (1)
    job = PointJob(specs=[ladder(cfg)[0]], cfg=cfg, train_path=files[0], val_path=files[1], out_dirs=[str(out)])
    t0 = time.perf_counter()
    result = train_points(job)[0]
    return result, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp")
    args = ap.parse_args()
    one = point_config(args.preset, args.steps, 1, args.parallel)
    two = dataclasses.replace(one, workers_per_point=2)
    shape = one.sizes[0]
    rng = np.random.default_rng(0)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(f"point: {args.preset}'s largest rung {shape.tag} (N_total={ladder(one)[0].n_params_total:,}), "
          f"vocab {one.vocab_size}, seq_len {one.seq_len}, global batch {one.batch_size * one.grad_accum} "
          f"sequences = 2 micro-batches of {one.batch_size}; {args.steps} steps; {args.parallel}; "
          f"torch {torch.__version__}; {torch.get_num_threads()} default threads; commit {commit}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        n = max(args.steps * one.batch_size * one.grad_accum * one.seq_len * 2, 1 << 18)
        files = (str(save_tokens(root / "train.npy", rng.integers(0, one.vocab_size, n, dtype=np.uint16))),
                 str(save_tokens(root / "val.npy", rng.integers(0, one.vocab_size, 8 * one.seq_len, dtype=np.uint16))))
        rows = [("W=1, 1 thread", *measure(one, files, root / "w1t1", 1)),
                ("W=1, 2 threads", *measure(one, files, root / "w1t2", 2)),
                ("W=2, 1 thread each", *measure(two, files, root / "w2", 1))]
    print(f"{'configuration':<22}{'tokens/s':>12}{'wall_s':>9}{'final train loss':>19}{'val_loss':>10}")
    for name, r, wall in rows:
        print(f"{name:<22}{r.tokens_per_s:>12,.0f}{wall:>9.1f}{r.history[-1][1]:>19.6f}{r.val_loss:>10.5f}")
    base1, base2, w2 = rows[0][1], rows[1][1], rows[2][1]
    print(f"ratio W=2 / W=1 (1 thread):  {w2.tokens_per_s / base1.tokens_per_s:.2f}x")
    print(f"ratio W=2 / W=1 (2 threads): {w2.tokens_per_s / base2.tokens_per_s:.2f}x  (same cores in use)")
    gap = abs(w2.val_loss - base1.val_loss)
    print(f"|val_loss W=2 - W=1| = {gap:.2e} (same samples, same schedule)")


if __name__ == "__main__":
    main()
