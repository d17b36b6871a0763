"""Activation-sparsity quality: TEAL against WINA, uniform against greedy allocation, at equal sparsity.

Run: ``.venv/bin/python benchmarks/sparse_quality.py [--model smollm2] [--model WORKDIR/models/trained/<variant>/<run>]
[--levels 0.25 0.4 0.5 0.65] [--sites all|mlp] [--settings teal_uniform winarot_uniform ...] [--eval-tokens 8192] [--calib-tokens 4096] [--out reports/bench]``

Every (method, allocation, level) is applied to the same model, sites and held-out text (SmolLM2-135M
on the news articles of the prepared validation split, calibrated on the training split, as in
benchmarks/quant_quality.py; a ladder model on its workdir's tokens) in ``mode: topk``, so every
token skips exactly the stated fraction of each site's input channels (uniform) or of the block's
weight reads (greedy): equal compute skipped, not equal nominal settings. Prints the perplexity
table and checks the goals of issue 10: WINA within 2% of TEAL's perplexity or better at every
level, and greedy allocation beating uniform for TEAL at 50%. Writes
``<out>/sparse_quality_<model>.csv``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quant_quality import model_and_text  # noqa: E402

from tasks.lm.loss import evaluate_loss  # noqa: E402
from tasks.sparse.registry import parse_settings, sparsify  # noqa: E402
from tasks.sparse.wina import ALL_LINEARS  # noqa: E402

SITES = {"all": list(ALL_LINEARS), "mlp": ["*.mlp.gate_proj", "*.mlp.up_proj", "*.mlp.down_proj"]}


VARIANTS = {
    "teal": {"method": "teal"},
    "wina": {"method": "wina"},
    # The paper's orthogonalising transform (k_proj, gate_proj), column norms everywhere.
    "winarot": {"method": "wina", "transform": True},
    # The authors' WINA scripts: the transform, column norms for gate and k only.
    "winacode": {"method": "wina", "transform": True, "norms": "gate_k"},
}


def settings(levels: list[float], sites: str, names: list[str] | None = None) -> dict:
    entries = {}
    for variant, fields in VARIANTS.items():
        for allocation in ("uniform", "greedy"):
            name = f"{variant}_{allocation}"
            if names is None and variant in ("teal", "wina") or names is not None and name in names:
                entries[name] = {**fields, "mode": "topk", "allocation": allocation, "targets": SITES[sites],
                                 "sparsities": levels}
    return parse_settings(entries)


def goals(rows: list[dict]) -> list[str]:
    by = {(r["setting"], r["sparsity"]): r["ppl"] for r in rows}
    out = []
    for variant in ("wina", "winarot", "winacode"):
        for alloc in ("uniform", "greedy"):
            for s in sorted({r["sparsity"] for r in rows}):
                t, w = by.get((f"teal_{alloc}", s)), by.get((f"{variant}_{alloc}", s))
                if t and w:
                    ok = w <= 1.02 * t
                    out.append(f"{'PASS' if ok else 'FAIL'} {variant} {alloc} @ {s:g}: ppl {w:.2f} vs TEAL {t:.2f} "
                               f"({100 * (w / t - 1):+.1f}%; goal <= +2%)")
    t, g = by.get(("teal_uniform", 0.5)), by.get(("teal_greedy", 0.5))
    if t and g:
        out.append(f"{'PASS' if g < t else 'FAIL'} TEAL greedy @ 0.5: ppl {g:.2f} vs uniform {t:.2f}")
    return out


def run_model(spec: str, args) -> list[dict]:
    import torch

    torch.set_num_threads(args.threads)
    model, val, calib, seq_len, name = model_and_text(spec, args.eval_tokens, args.calib_tokens)
    dense = math.exp(evaluate_loss(model, val, seq_len, args.batch_size))
    print(f"[{name}] dense ppl {dense:.2f} on {len(val) - 1} tokens; sites {args.sites}", flush=True)
    rows = []
    for setting, (method, cfg) in settings(args.levels, args.sites, args.settings).items():
        for s in cfg.sparsities:
            t = time.perf_counter()
            with sparsify(model, cfg, sparsity=s, calib_tokens=calib) as handle:
                loss = evaluate_loss(model, val, seq_len, args.batch_size)
            rows.append({"model": name, "setting": setting, "method": method, "allocation": cfg.allocation,
                         "sites": args.sites, "sparsity": s, "achieved_sparsity": handle.achieved_sparsity(),
                         "ppl": math.exp(loss), "ppl_dense": dense, "seconds": round(time.perf_counter() - t, 1)})
            print(f"[{name}] {setting:15s} @ {s:<4g} achieved {handle.achieved_sparsity():.3f}  ppl {math.exp(loss):8.2f}"
                  f"  ({time.perf_counter() - t:.0f}s)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pl.DataFrame(rows).write_csv(out / f"sparse_quality_{name}.csv")
    levels = sorted({r["sparsity"] for r in rows})
    print(f"\n| {name} ({args.sites} linears), ppl (dense {dense:.2f}) | " + " | ".join(f"{s:g}" for s in levels)
          + " |\n|---|" + "---|" * len(levels))
    for setting in dict.fromkeys(r["setting"] for r in rows):
        ppl = {r["sparsity"]: r["ppl"] for r in rows if r["setting"] == setting}
        print(f"| {setting} | " + " | ".join(f"{ppl[s]:.2f}" for s in levels) + " |")
    print()
    for line in goals(rows):
        print(line)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", help="smollm2 or a trained model folder (repeatable; default smollm2)")
    p.add_argument("--levels", type=float, nargs="+", default=[0.25, 0.4, 0.5, 0.65])
    p.add_argument("--sites", choices=sorted(SITES), default="all")
    p.add_argument("--settings", nargs="+", metavar="NAME",
                   help="<variant>_<uniform|greedy> with variant in " + ", ".join(VARIANTS)
                   + " (default: teal and wina, both allocations)")
    p.add_argument("--eval-tokens", type=int, default=8192)
    p.add_argument("--calib-tokens", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="reports/bench")
    args = p.parse_args()
    for spec in args.model or ["smollm2"]:
        run_model(spec, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
