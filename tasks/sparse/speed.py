"""Measured speed of a sparse path against the dense path of the same model, timed side by side.

The ``speedup`` column of ``reports/sparse_eval.csv``: dense time over sparse time, both measured
in the same process, interleaved (:func:`interleaved`), on the shapes of the evaluated model:

* activation sparsity (TEAL, WINA) — one decoding step (batch 1) through the model's MLP linears
  (``gate_proj``, ``up_proj``, ``down_proj`` of one block): :mod:`kernels.sparse_gemv`, which reads
  only the weight columns of the kept input channels, at the level's share of channels skipped,
  against ``torch.matmul`` with every weight. Which channels survive does not change the cost, so
  TEAL and WINA at one level time the same; the inputs are random.
* sparse prefill attention (QuoKA, ProxyAttn) — one layer's attention over ``seq_len`` tokens
  (random queries, keys and values of the model's head counts and head size): the method's
  selection and sparse attention (the handle's ``attend``) against causal
  ``scaled_dot_product_attention``. The handle's pair counts are left as they were.

Small models give small problems, where the sparse paths' fixed costs dominate: a speed-up below 1
is a measurement, not an error.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kernels.sparse_gemv import sparse_gemv


def interleaved(candidates: dict[str, Callable[[], object]], rounds: int, repeats: int = 1) -> dict[str, float]:
    """Median seconds per call of each candidate: per round the median of ``repeats`` calls, candidates
    taking turns within a round; then the median over rounds. One warm-up call each first."""
    for fn in candidates.values():
        fn()
    per_round: dict[str, list[float]] = {k: [] for k in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            samples = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
            per_round[name].append(statistics.median(samples))
    return {k: statistics.median(v) for k, v in per_round.items()}


def _mlp(model: nn.Module) -> list[nn.Linear]:
    block = next((m for m in model.modules() if all(hasattr(m, p) for p in ("gate_proj", "up_proj", "down_proj"))),
                 None)
    if block is None:
        raise ValueError(f"{type(model).__name__}: no Llama-family MLP (gate_proj/up_proj/down_proj) to time")
    return [block.gate_proj, block.up_proj, block.down_proj]


@torch.no_grad()
def linear_speedup(model: nn.Module, sparsity: float, *, rounds: int = 5, repeats: int = 20, seed: int = 0) -> float:
    """Dense over sparse time of one decoding step through one block's MLP linears, ``sparsity`` of
    each input's channels skipped (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    sites = []
    for lin in _mlp(model):
        w = lin.weight.detach().float()
        w_cm = w.t().contiguous().t()  # channel-major: a kept channel's column is contiguous
        x = torch.randn(1, w.shape[1], generator=g)
        keep = w.shape[1] - round(sparsity * w.shape[1])
        threshold = float(x.abs().flatten().kthvalue(w.shape[1] - keep + 1).values) if keep < w.shape[1] else 0.0
        sites.append((x, w, w_cm, threshold if keep else float("inf")))
    times = interleaved({
        "dense": lambda: [torch.matmul(x, w.t()) for x, w, _, _ in sites],
        "sparse": lambda: [sparse_gemv(x, w_cm, threshold=t) for x, _, w_cm, t in sites],
    }, rounds, repeats)
    return times["dense"] / times["sparse"]


@torch.no_grad()
def attention_speedup(model: nn.Module, handle, seq_len: int, *, rounds: int = 3, seed: int = 0) -> float:
    """Dense over sparse time of one layer's prefill attention over ``seq_len`` tokens, the sparse side
    being ``handle.attend`` (:class:`tasks.sparse.attention.AttentionSparsity`)."""
    cfg = model.config
    hq = cfg.num_attention_heads
    hkv = getattr(cfg, "num_key_value_heads", None) or hq
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, hq, seq_len, d, generator=g)
    k, v = torch.randn(1, hkv, seq_len, d, generator=g), torch.randn(1, hkv, seq_len, d, generator=g)
    counts = handle.skipped, handle.visible
    try:
        times = interleaved({
            "dense": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
            "sparse": lambda: handle.attend(handle, q, k, v, None, d**-0.5),
        }, rounds)
    finally:
        handle.skipped, handle.visible = counts
    return times["dense"] / times["sparse"]


def measured_speedup(model: nn.Module, handle, sparsity: float, seq_len: int, which: str = "all") -> float | None:
    """The ``speedup`` of a sparse_eval point: attention for attention handles, MLP linears for
    activation sparsity (``which``: ``all``, ``attention`` or ``none``); None when not timed."""
    if hasattr(handle, "attend"):
        return attention_speedup(model, handle, seq_len) if which in ("all", "attention") else None
    return linear_speedup(model, sparsity) if which == "all" and sparsity > 0 else None
