"""DDCF in setting (a): DDCF at 1% of the pool against random selection of the same size and the
full pool, and the predictor's AUC, in one run.

Run: ``.venv/bin/python benchmarks/ddcf_quality.py [--preset demo] [--fraction 0.01] [--repeats 3]
[--methods ddcf,random,difficulty,diversity,full] [--threads 1]``

Everything else comes from params/select.yaml under ``--preset`` (the stage's own config): the same
question family, pool of models, seed set, predictor and fine-tuning. Each method is fine-tuned
``--repeats`` times (random draws a new selection each time; the other methods refit theirs with
another fine-tuning order), and the table gives the mean and standard deviation of the target's
test accuracy. Goals (issue 12): the predictor's AUC on held-out (model, question) cells >= 0.75;
DDCF at 1% beats random at 1% and comes within 1 point of the full pool. ``target_pool_auc`` is
the AUC of the target's predicted P(correct) against its true correctness on the unlabelled pool
(known here because the family is generated), the ranking the selection actually uses.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import polars as pl  # noqa: E402

from tasks.common.params import load_stage_config  # noqa: E402
from tasks.curation.ddcf import METHODS, SelectConfig, run_arithmetic_setting  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="demo", choices=("ci", "demo", "full"))
    ap.add_argument("--fraction", type=float, default=0.01, help="k as a share of the pool (default 1%%)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--schedule", choices=("steps", "epochs"), help="fine-tuning schedule (default: the preset's)")
    args = ap.parse_args()

    cfg = load_stage_config(SelectConfig, ROOT, "select", args.preset)
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    cfg = dataclasses.replace(cfg, k_fractions=(args.fraction,), repeats=args.repeats, methods=methods,
                              num_threads=args.threads)
    if args.schedule:
        cfg = dataclasses.replace(cfg, finetune=dataclasses.replace(cfg.finetune, schedule=args.schedule))
    start = time.perf_counter()
    result = run_arithmetic_setting(cfg, log=lambda s: print(f"[{time.perf_counter() - start:6.1f} s] {s}",
                                                             flush=True))
    elapsed = time.perf_counter() - start
    rows = pl.DataFrame(result.rows, infer_schema_length=None)
    table = (rows.group_by(["target", "method", "k", "labels_used"], maintain_order=True)
             .agg(pl.col("accuracy").mean().alias("mean"), pl.col("accuracy").std().alias("sd"),
                  pl.col("accuracy").min().alias("min"), pl.col("accuracy").max().alias("max"),
                  pl.len().alias("runs"), pl.col("selected_pool_accuracy").mean().alias("sel_base_acc")))
    print(f"\nsetting (a), preset {args.preset}: pool {cfg.n_pool}, seed {cfg.n_seed}, test {cfg.n_test}, "
          f"{cfg.pool.n_models} pool models, k = {cfg.ks()[0]} ({args.fraction:.0%}), "
          f"fine-tuning {cfg.finetune.schedule} ({cfg.finetune.steps} steps, {cfg.finetune.epochs:g} epochs), "
          f"{elapsed:.0f} s\n")
    print("| target | method | k | labels used | accuracy mean | sd | min | max | runs | target's base acc. on selection |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in table.iter_rows(named=True):
        sd = f"{r['sd']:.3f}" if r["sd"] is not None else ""
        sel = f"{r['sel_base_acc']:.3f}" if r["sel_base_acc"] is not None else ""
        print(f"| {r['target']} | {r['method']} | {r['k']} | {r['labels_used']} | {r['mean']:.3f} | {sd} | "
              f"{r['min']:.3f} | {r['max']:.3f} | {r['runs']} | {sel} |")
    print()
    for target in cfg.targets:
        m = result.metrics
        auc, pool_auc = m.get(f"{target}.predictor_auc"), m.get(f"{target}.target_pool_auc")
        print(f"{target}: predictor AUC on held-out cells {auc:.3f} (goal >= 0.75: {'met' if auc >= 0.75 else 'NOT met'}); "
              f"target's pool AUC {pool_auc:.3f}")
        mean = {r["method"]: r["mean"] for r in table.iter_rows(named=True) if r["target"] == target}
        if {"ddcf", "random", "full"} <= set(mean):
            d_r, d_f = mean["ddcf"] - mean["random"], mean["ddcf"] - mean["full"]
            print(f"{target}: DDCF - random = {100 * d_r:+.1f} points (goal > 0: {'met' if d_r > 0 else 'NOT met'}); "
                  f"DDCF - full pool = {100 * d_f:+.1f} points (goal >= -1: {'met' if d_f >= -0.01 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
