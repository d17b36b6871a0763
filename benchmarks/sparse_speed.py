"""Sparse-inference speed on this CPU, each path timed side by side with its dense baseline in one run.

Run: ``.venv/bin/python benchmarks/sparse_speed.py [--threads 2] [--part linear attention]
[--lengths 4096 8192] [--rounds 7] [--out reports/bench]``

1. Decode-step linear (batch 1, fp32): TEAL/WINA's sparse path at 50% of input channels skipped —
   :func:`kernels.sparse_gemv.cpu.sparse_gemv` on a channel-major weight, the threshold at the
   median ``|x|`` of each input — against dense ``torch.matmul`` on the same weight, for a 7B MLP's
   up (4096->11008) and down (11008->4096) projections and SmolLM2-135M's (576->1536, 1536->576).
   The baseline is the faster of ``x @ W.T`` (``nn.Linear``'s row-major weight) and ``x @ W_t``
   (the same channel-major copy the sparse kernel reads). Also shown: the C++ kernel with every
   channel kept (what the kernel alone gains over ``torch.matmul``, not the skipping) and the torch
   reference (``embedding_bag``). Inputs rotate through 8 vectors so the active set changes per call.
   Goals (issue 10): >= 1.6x on 4096->11008, >= 1.3x on 11008->4096.
2. Prefill attention of one SmolLM2 layer (9 query heads, 3 KV heads, head dim 64, fp32, random
   q/k/v) at ``--lengths`` tokens: QuoKA (chunks of 128 and of 512; chunks of 128 with 64 and all 128
   queries as probes, its accurate settings) and ProxyAttn (blocks of 16, the
   quality setting; blocks of 64 with every query scoring the proxy, and with its last 16 only) at a
   12% KV budget (sparsity 0.88) against dense causal ``scaled_dot_product_attention``. Each method
   chooses its keys and attends through :mod:`kernels.sparse_attention` (on CPU: the chosen keys
   gathered, problems bucketed by list length, PyTorch's fused attention). Goal (issue 10): >= 3x at
   8k tokens.

Timing: ``--rounds`` interleaved rounds; in each, every candidate of a row runs its repeats and
records the median; the table gives the median over rounds, and ratios are dense / candidate.
Writes ``<out>/sparse_speed.csv``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import polars as pl
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.sparse_gemv import cpu as sg_cpu  # noqa: E402
from kernels.sparse_gemv import reference as sg_reference  # noqa: E402
from tasks.sparse.speed import interleaved  # noqa: E402

LINEAR_SHAPES = [  # (in, out, goal)
    (4096, 11008, 1.6),
    (11008, 4096, 1.3),
    (576, 1536, None),
    (1536, 576, None),
]
ATTENTION_GOAL = 3.0  # at 8k tokens


def linear_rows(rounds: int) -> list[dict]:
    if not sg_cpu.available():
        print("kernels.sparse_gemv.cpu did not build (see the warning above): timing the reference only")
    rows = []
    for n_in, n_out, goal in LINEAR_SHAPES:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(n_out, n_in, generator=g) / n_in**0.5  # (out, in): nn.Linear's layout
        w_t = w.t().contiguous()  # (in, out): channel i's column is the contiguous row w_t[i]
        xs = [torch.randn(1, n_in, generator=g) for _ in range(8)]
        thresholds = [float(x.abs().median()) for x in xs]
        state = {"i": 0}

        def nxt() -> int:
            state["i"] = (state["i"] + 1) % len(xs)
            return state["i"]

        def sparse(threshold_of: Callable[[int], float]) -> Callable[[], object]:
            def run():
                i = nxt()
                return sg_cpu.sparse_gemv(xs[i], w_t.t(), threshold=threshold_of(i))
            return run

        candidates = {
            "dense x @ W.T (row-major)": lambda: torch.matmul(xs[nxt()], w.t()),
            "dense x @ W_t (channel-major)": lambda: torch.matmul(xs[nxt()], w_t),
            "sparse 50%: C++ kernel": sparse(lambda i: thresholds[i]),
            "all channels: C++ kernel": sparse(lambda i: 0.0),
            "sparse 50%: reference (embedding_bag)": lambda: sg_reference.sparse_gemv(
                xs[nxt()], w_t.t(), threshold=thresholds[state["i"]]),
        }
        # the weights outgrow the caches at 7B shapes: fewer, longer calls there
        repeats = 10 if n_in * n_out > 4_000_000 else 200
        times = interleaved(candidates, rounds, repeats)
        dense = min(times["dense x @ W.T (row-major)"], times["dense x @ W_t (channel-major)"])
        mib = n_in * n_out * 4 / 2**20
        for name, t in times.items():
            kept = 0.5 if name.startswith("sparse") else 1.0
            rows.append({"part": "linear", "shape": f"{n_in}->{n_out}", "weight_mib": round(mib, 1), "candidate": name,
                         "ms": t * 1e3, "speedup": dense / t, "gb_per_s": kept * mib * 2**20 / t / 1e9,
                         "goal": goal if name == "sparse 50%: C++ kernel" else None})
        print(f"[linear {n_in}->{n_out}] " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in times.items()), flush=True)
    return rows


def attention_rows(lengths: list[int], rounds: int) -> list[dict]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tasks.sparse.proxyattn import ProxyAttnConfig, proxyattn
    from tasks.sparse.quoka import QuokaConfig, quoka

    hq, hkv, d = 9, 3, 64  # SmolLM2-135M's attention
    shell = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=hq * d, intermediate_size=8, num_hidden_layers=1,
                                         num_attention_heads=hq, num_key_value_heads=hkv,
                                         max_position_embeddings=max(lengths))).eval()
    handles = {"QuoKA 12% (chunk 128)": quoka(shell, QuokaConfig(chunk_size=128), sparsity=0.88),
               "QuoKA 12% (chunk 512)": quoka(shell, QuokaConfig(chunk_size=512), sparsity=0.88),
               "QuoKA 12% (chunk 128, n_queries 64)": quoka(shell, QuokaConfig(chunk_size=128, n_queries=64),
                                                           sparsity=0.88),
               "QuoKA 12% (chunk 128, n_queries 128)": quoka(shell, QuokaConfig(chunk_size=128, n_queries=128),
                                                            sparsity=0.88),
               "ProxyAttn 12% (block 16)": proxyattn(shell, ProxyAttnConfig(block_size=16), sparsity=0.88),
               "ProxyAttn 12% (block 64)": proxyattn(shell, ProxyAttnConfig(block_size=64), sparsity=0.88),
               "ProxyAttn 12% (block 64, proxy_queries 16)": proxyattn(
                   shell, ProxyAttnConfig(block_size=64, proxy_queries=16), sparsity=0.88)}
    rows = []
    for n in lengths:
        g = torch.Generator().manual_seed(n)
        q = torch.randn(1, hq, n, d, generator=g)
        k, v = torch.randn(1, hkv, n, d, generator=g), torch.randn(1, hkv, n, d, generator=g)
        scaling = d**-0.5
        candidates: dict[str, Callable[[], object]] = {
            "dense SDPA (causal)": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)}
        for name, h in handles.items():
            candidates[name] = (lambda h=h: h.attend(h, q, k, v, None, scaling))
        with torch.no_grad():
            for h in handles.values():
                h.reset_counts()
            times = interleaved(candidates, rounds, 1)
        dense = times["dense SDPA (causal)"]
        for name, t in times.items():
            h = handles.get(name)
            rows.append({"part": "attention", "shape": f"{n} tokens", "candidate": name, "ms": t * 1e3,
                         "speedup": dense / t, "achieved_sparsity": h.achieved_sparsity() if h else 0.0,
                         "goal": ATTENTION_GOAL if h is not None and n == 8192 else None})
        print(f"[attention {n}] " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in times.items()), flush=True)
    return rows


def report(rows: list[dict]) -> None:
    for part in ("linear", "attention"):
        sel = [r for r in rows if r["part"] == part]
        if not sel:
            continue
        extra = "GB/s of weights read" if part == "linear" else "achieved sparsity"
        print(f"\n| {part} | candidate | ms (median) | vs dense | {extra} |\n|---|---|---|---|---|")
        for r in sel:
            x = f"{r['gb_per_s']:.1f}" if part == "linear" else f"{r['achieved_sparsity']:.3f}"
            print(f"| {r['shape']} | {r['candidate']} | {r['ms']:.3f} | {r['speedup']:.2f}x | {x} |")
    print()
    for r in rows:
        if r.get("goal"):
            ok = r["speedup"] >= r["goal"]
            print(f"{'PASS' if ok else 'FAIL'} {r['part']} {r['shape']} {r['candidate']}: {r['speedup']:.2f}x "
                  f"vs dense (goal >= {r['goal']:g}x)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--part", nargs="+", choices=["linear", "attention"], default=["linear", "attention"])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds for the linear part")
    p.add_argument("--attention-rounds", type=int, default=5)
    p.add_argument("--out", default="reports/bench")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, C++ sparse GEMV built: {sg_cpu.available()}",
          flush=True)
    rows = []
    if "linear" in args.part:
        rows += linear_rows(args.rounds)
    if "attention" in args.part:
        rows += attention_rows(args.lengths, args.attention_rounds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pl.DataFrame(rows).write_csv(out / "sparse_speed.csv")
    report(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
