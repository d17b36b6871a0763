"""Block pruning of Llama-family decoders: EntroDrop and the cosine (angular-distance) baseline.

A *block* is a whole decoder layer, its attention sub-block or its MLP sub-block (``granularity``).
Both methods run calibration windows through the model once, record the residual stream at every
block boundary and score each block from its input ``Z_{l-1}`` and output ``Z_l``:

* **EntroDrop** (Yang, Xu, Tan, Sahoo, Savarese, Xiong, Wang & Heinecke 2025, "Entropy-Based Block
  Pruning for Efficient Large Language Models", arXiv:2504.03794; code SalesforceAIResearch/EntroDrop): the entropy
  of the hidden representations falls over the first blocks and rises afterwards; a block that adds
  little entropy ``ΔH_l = H(Z_l) - H(Z_{l-1})`` inside the increasing phase carries little new
  information and is removed. ``H`` is estimated per calibration batch over the batch's token
  vectors with a bucket (histogram) or a k-NN (Kozachenko–Leonenko) estimator and averaged over batches.
* **cosine_drop** (ShortGPT's block influence ``1 - cos``: Men et al. 2024, "ShortGPT: Layers in Large
  Language Models are More Redundant Than You Expect", arXiv:2403.03853; measured as the angular
  distance of Gromov et al. 2024, "The Unreasonable Ineffectiveness of the Deeper Layers", arXiv:2403.17887):
  ``score_l = mean_tokens arccos(cos(Z_{l-1}, Z_l)) / π``; the blocks that turn the residual stream
  least are removed, each scored on its own (ShortGPT), not as one run of ``n`` consecutive layers
  (Gromov et al.).

Removal keeps the model a runnable transformers model (:func:`remove_blocks`): whole layers are
deleted, ``config.num_hidden_layers`` (and ``config.layer_types``) follow, and the remaining
attention modules are renumbered ``0..K-1`` so the KV cache stays consistent; a removed attention or
MLP sub-block is replaced by :class:`RemovedBlock`, which adds zero to the residual stream, and its
pre-norm by ``nn.Identity``.

>>> pruned = entrodrop(model, EntroDropConfig(n_remove=2, granularity="attention"), calib_tokens=tokens)  # doctest: +SKIP
>>> pruned.removed, pruned.params_removed                                                                   # doctest: +SKIP
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from tasks.common.config import at_least, require, to_dict
from tasks.common.registry import MethodSpec
from tasks.compression._calib import calibration_windows, model_seq_len
from tasks.compression.registry import register_pruner

GRANULARITIES = ("layer", "attention", "mlp")
ESTIMATORS = ("knn", "histogram")
PHASES = ("increasing", "all")
_SUBMODULES = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")


@dataclass(frozen=True, kw_only=True)
class BlockPruneConfig(MethodSpec):
    """What every block-pruning method shares.

    ``n_remove``: blocks to remove. ``granularity``: ``layer`` (whole decoder layers), ``attention``
    or ``mlp`` (sub-blocks; the other half of each layer stays). ``keep_first``/``keep_last``: blocks
    at either end never removed (the public EntroDrop code always keeps the last layer; the first
    and last layers are the ones every depth-pruning paper finds indispensable).
    ``calib_windows`` windows of ``seq_len`` calibration tokens, run ``batch_size`` at a time;
    ``skip_first_tokens``: positions at the start of each window left out of the statistics. The
    first position is the attention sink, whose hidden state carries the massive activations (Sun
    et al., 2024); the public EntroDrop code keeps it, and so do we by default (what leaving it out
    did on SmolLM2-135M is in docs/pruning.md).
    """

    method: str = "block_prune"
    n_remove: int = 1
    granularity: Literal["layer", "attention", "mlp"] = "layer"
    keep_first: int = 0
    keep_last: int = 1
    calib_windows: int = 8
    seq_len: int = 256
    batch_size: int = 4
    skip_first_tokens: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least(self.n_remove, 1, "n_remove")
        require(self.granularity in GRANULARITIES, "granularity",
                f"must be one of {list(GRANULARITIES)}, got {self.granularity!r}")
        at_least(self.keep_first, 0, "keep_first")
        at_least(self.keep_last, 0, "keep_last")
        at_least(self.calib_windows, 1, "calib_windows")
        at_least(self.seq_len, 2, "seq_len")
        at_least(self.batch_size, 1, "batch_size")
        require(0 <= self.skip_first_tokens < self.seq_len, "skip_first_tokens",
                f"must be in 0..seq_len-1 ({self.seq_len - 1}), got {self.skip_first_tokens}")


@dataclass(frozen=True, kw_only=True)
class EntroDropConfig(BlockPruneConfig):
    """EntroDrop. ``estimator``: ``knn`` (Kozachenko–Leonenko with the ``knn_k``-th neighbour; the
    public code's default k = 25) or ``histogram`` (``bins`` equal-width buckets per dimension between
    its min and max, the public code's 20; see :func:`histogram_entropy` for ``histogram_differential``).
    ``phase``: ``increasing`` keeps only blocks at or after the minimum of the entropy trajectory as
    candidates (the paper's increasing phase), ``all`` ranks every block. Entropy is estimated over
    the tokens of one batch at a time and averaged over batches, so ``batch_size`` is also the sample
    of each estimate: 1 (one sequence), as in the public code, by default."""

    method: Literal["entrodrop"] = "entrodrop"
    batch_size: int = 1
    estimator: Literal["knn", "histogram"] = "knn"
    knn_k: int = 25
    bins: int = 20
    histogram_differential: bool = True
    phase: Literal["increasing", "all"] = "increasing"

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.estimator in ESTIMATORS, "estimator", f"must be one of {list(ESTIMATORS)}, got {self.estimator!r}")
        at_least(self.knn_k, 1, "knn_k")
        at_least(self.bins, 2, "bins")
        require(self.phase in PHASES, "phase", f"must be one of {list(PHASES)}, got {self.phase!r}")


@dataclass(frozen=True, kw_only=True)
class CosineDropConfig(BlockPruneConfig):
    """Angular-distance (cosine) block pruning: the baseline EntroDrop is compared with."""

    method: Literal["cosine_drop"] = "cosine_drop"


# ---------------------------------------------------------------------------------------------
# Entropy estimators


def knn_entropy(x: torch.Tensor, k: int = 25) -> float:
    """Kozachenko–Leonenko differential entropy (nats) of the rows of ``x`` (N, d)::

        H = ψ(N) - ψ(k) + log V_d + (d / N) Σ_i log r_i,   V_d = π^{d/2} / Γ(d/2 + 1)

    with ``r_i`` the Euclidean distance from row i to its k-th nearest other row. Exact duplicate
    rows are dropped first (a zero distance has no density; causal models map identical prefixes
    to identical vectors). Cost O(N² d); ``k`` is capped at N - 1.

    >>> knn_entropy(torch.randn(2000, 2), k=5)   # log(2πe) = 2.84   # doctest: +SKIP
    2.83
    """
    x = torch.unique(x.detach().double(), dim=0)  # float64: cdist's |x|²+|y|²-2x·y form cancels in float32
    n, d = x.shape
    if n < 2:
        raise ValueError(f"x: need at least 2 distinct rows to estimate an entropy, got {n}")
    k = min(k, n - 1)
    dist = torch.cdist(x, x)
    dist.fill_diagonal_(float("inf"))
    r = dist.kthvalue(k, dim=1).values
    log_ball = (d / 2) * math.log(math.pi) - math.lgamma(d / 2 + 1)
    psi = torch.special.digamma(torch.tensor([float(n), float(k)], dtype=torch.float64))
    return float(psi[0] - psi[1] + log_ball + d * torch.log(r).mean())


def histogram_entropy(x: torch.Tensor, bins: int = 20, *, differential: bool = True) -> float:
    """Bucket estimate of the entropy (nats) of the rows of ``x`` (N, d): the sum over dimensions of
    each dimension's marginal entropy, ``bins`` equal-width buckets between its min and max::

        H = Σ_j ( -Σ_b p_jb log p_jb + log Δ_j ),   Δ_j = (max_j - min_j) / bins

    ``differential=True`` adds ``log Δ_j``, turning the bucket entropy into the histogram estimate of
    the differential entropy, so a wider distribution scores higher (as the k-NN estimate does). The
    public EntroDrop code omits it (``differential=False``): buckets then follow each dimension's
    range and the estimate measures only the shape of the marginals, not their scale. Summing
    marginals ignores the dependence between dimensions (an upper bound on the joint entropy).
    """
    x = x.detach().float()
    n, d = x.shape
    if n < 2:
        raise ValueError(f"x: need at least 2 rows to estimate an entropy, got {n}")
    lo, hi = x.min(0).values, x.max(0).values
    width = (hi - lo).clamp_min(torch.finfo(torch.float32).tiny) / bins
    idx = ((x - lo) / width).floor().long().clamp_(0, bins - 1)  # the maximum falls in the last bucket
    counts = torch.zeros(d, bins, dtype=torch.float64)
    counts.scatter_add_(1, idx.T.contiguous(), torch.ones(d, n, dtype=torch.float64))
    p = counts / n
    h = -(p * torch.log(p.clamp_min(1e-300))).sum(1)
    if differential:
        h = h + torch.log(width.double())
    return float(h.sum())


# ---------------------------------------------------------------------------------------------
# The residual stream at block boundaries


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a Llama-family model (``model.model.layers``).

    Raises ``ValueError`` naming ``model`` when there is no such list or a layer lacks one of
    ``self_attn``, ``mlp``, ``input_layernorm``, ``post_attention_layernorm``.
    """
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"model: {type(model).__name__} has no decoder layers at .model.layers "
                         f"(block pruning supports Llama-family decoders)")
    for i, layer in enumerate(layers):
        missing = [m for m in _SUBMODULES if not isinstance(getattr(layer, m, None), nn.Module)]
        if missing:
            raise ValueError(f"model: decoder layer {i} ({type(layer).__name__}) has no {missing}; block pruning "
                             f"needs the Llama layout {list(_SUBMODULES)}")
    return layers


def boundary_states(model: nn.Module, batch: torch.Tensor, *, skip_first_tokens: int = 0) -> list[torch.Tensor]:
    """The residual stream at every sub-block boundary for one batch of token ids (B, T).

    Returns ``2L + 1`` tensors (N, d) float32, ``N = B * (T - skip_first_tokens)``: index ``2l`` is
    the input of layer ``l`` (0 = the embeddings), ``2l + 1`` the stream after its attention
    residual add, ``2l + 2`` its output. Layer ``l``'s blocks: whole layer ``2l -> 2l+2``, attention
    ``2l -> 2l+1``, MLP ``2l+1 -> 2l+2``.
    """
    layers = decoder_layers(model)
    states: dict[int, torch.Tensor] = {}

    def keep(i: int, h: torch.Tensor) -> None:
        states[i] = h[:, skip_first_tokens:].reshape(-1, h.shape[-1]).detach().float().cpu()

    handles = []
    for l, layer in enumerate(layers):
        if l == 0:
            handles.append(layer.register_forward_pre_hook(lambda m, a, kw, l=l: keep(0, a[0] if a else kw["hidden_states"]),
                                                           with_kwargs=True))
        handles.append(layer.post_attention_layernorm.register_forward_pre_hook(lambda m, a, l=l: keep(2 * l + 1, a[0])))
        handles.append(layer.register_forward_hook(
            lambda m, a, out, l=l: keep(2 * l + 2, out[0] if isinstance(out, tuple) else out)))
    try:
        with torch.no_grad():
            model(input_ids=batch.to(next(model.parameters()).device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return [states[i] for i in range(2 * len(layers) + 1)]


def _block_edges(n_layers: int, granularity: str) -> list[tuple[int, int]]:
    """(input state, output state) of each block, one per layer, in :func:`boundary_states` indices."""
    if granularity == "layer":
        return [(2 * l, 2 * l + 2) for l in range(n_layers)]
    if granularity == "attention":
        return [(2 * l, 2 * l + 1) for l in range(n_layers)]
    return [(2 * l + 1, 2 * l + 2) for l in range(n_layers)]


def _trajectory(n_layers: int, granularity: str) -> list[int]:
    """The states the increasing phase is found on: layer boundaries, or every sub-block boundary."""
    return list(range(0, 2 * n_layers + 1, 2)) if granularity == "layer" else list(range(2 * n_layers + 1))


@dataclass
class BlockScores:
    """Per-block scores of one model (index = layer index; lower = removed first).

    ``scores``: EntroDrop's entropy increase ``ΔH_l`` or cosine_drop's angular distance.
    ``candidates``: the layers whose block may be removed (after the phase and keep_first/keep_last).
    ``entropy``: ``{state index: H}`` averaged over batches (EntroDrop only), ``phase_start``: the
    state index where the increasing phase begins (EntroDrop with ``phase: increasing``).
    """

    method: str
    granularity: str
    scores: list[float]
    candidates: list[int]
    entropy: dict[int, float] | None = None
    phase_start: int | None = None


def _windows(model: nn.Module, cfg: BlockPruneConfig, calib_tokens: np.ndarray | torch.Tensor | None) -> torch.Tensor:
    return calibration_windows(calib_tokens, model_seq_len(model, cfg.seq_len), cfg.calib_windows, method=cfg.method)


def _batches(windows: torch.Tensor, batch_size: int):
    for start in range(0, len(windows), batch_size):
        yield windows[start : start + batch_size]


def _kept_ends(n_layers: int, cfg: BlockPruneConfig) -> list[int]:
    return [l for l in range(n_layers) if cfg.keep_first <= l < n_layers - cfg.keep_last]


def entropy_scores(model: nn.Module, cfg: EntroDropConfig, *, calib_tokens: np.ndarray | torch.Tensor | None) -> BlockScores:
    """EntroDrop's scores: ``ΔH_l = H(Z_l) - H(Z_{l-1})`` per block, entropies averaged over batches.

    The increasing phase starts at the state of minimum entropy along the granularity's trajectory
    (layer boundaries for ``layer``, every sub-block boundary otherwise); with ``phase: increasing``
    only blocks whose input lies at or after it are candidates.
    """
    layers = decoder_layers(model)
    edges = _block_edges(len(layers), cfg.granularity)
    wanted = sorted({s for e in edges for s in e} | set(_trajectory(len(layers), cfg.granularity)))
    sums = dict.fromkeys(wanted, 0.0)
    n_batches = 0
    for batch in _batches(_windows(model, cfg, calib_tokens), cfg.batch_size):
        states = boundary_states(model, batch, skip_first_tokens=cfg.skip_first_tokens)
        for s in wanted:
            if cfg.estimator == "knn":
                sums[s] += knn_entropy(states[s], cfg.knn_k)
            else:
                sums[s] += histogram_entropy(states[s], cfg.bins, differential=cfg.histogram_differential)
        n_batches += 1
    entropy = {s: v / n_batches for s, v in sums.items()}
    scores = [entropy[b] - entropy[a] for a, b in edges]
    trajectory = _trajectory(len(layers), cfg.granularity)
    phase_start = min(trajectory, key=lambda s: (entropy[s], s)) if cfg.phase == "increasing" else None
    candidates = [l for l in _kept_ends(len(layers), cfg) if phase_start is None or edges[l][0] >= phase_start]
    return BlockScores(cfg.method, cfg.granularity, scores, candidates, entropy, phase_start)


def angular_scores(model: nn.Module, cfg: BlockPruneConfig, *, calib_tokens: np.ndarray | torch.Tensor | None) -> BlockScores:
    """cosine_drop's scores: mean over calibration tokens of ``arccos(cos(Z_{l-1}, Z_l)) / π`` per block."""
    layers = decoder_layers(model)
    edges = _block_edges(len(layers), cfg.granularity)
    sums = np.zeros(len(layers))
    n = 0
    for batch in _batches(_windows(model, cfg, calib_tokens), cfg.batch_size):
        states = boundary_states(model, batch, skip_first_tokens=cfg.skip_first_tokens)
        for l, (a, b) in enumerate(edges):
            cos = torch.nn.functional.cosine_similarity(states[a].double(), states[b].double(), dim=-1)
            sums[l] += float((torch.arccos(cos.clamp(-1.0, 1.0)) / math.pi).sum())
        n += states[0].shape[0]
    return BlockScores(cfg.method, cfg.granularity, [float(s / n) for s in sums], _kept_ends(len(layers), cfg))


def select_blocks(scores: BlockScores, n_remove: int) -> list[int]:
    """The ``n_remove`` candidate layers with the lowest scores (ties: the earlier layer), sorted.

    Raises ``ValueError`` naming ``n_remove`` when there are fewer candidates.
    """
    if n_remove > len(scores.candidates):
        raise ValueError(
            f"n_remove: {n_remove} {scores.granularity} blocks asked for, but only {len(scores.candidates)} are "
            f"candidates (layers {scores.candidates}; keep_first/keep_last"
            + (", the entropy-increasing phase from state " + str(scores.phase_start) if scores.phase_start is not None else "")
            + " exclude the rest)")
    ranked = sorted(scores.candidates, key=lambda l: (scores.scores[l], l))
    return sorted(ranked[:n_remove])


# ---------------------------------------------------------------------------------------------
# Removal


class RemovedBlock(nn.Module):
    """Stands in for a removed attention or MLP sub-block: adds nothing to the residual stream.

    ``kind="attention"`` returns ``(zeros, None)`` like a transformers attention module and never
    touches the KV cache; ``kind="mlp"`` returns zeros.
    """

    def __init__(self, kind: Literal["attention", "mlp"]) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any):
        zero = torch.zeros_like(hidden_states)
        return (zero, None) if self.kind == "attention" else zero

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}"


def _count(modules: Sequence[nn.Module]) -> int:
    seen: set[int] = set()
    total = 0
    for m in modules:
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
    return total


def _renumber_attention(model: nn.Module, layers: nn.ModuleList) -> None:
    """Number the remaining attention modules ``0..K-1`` so each owns one KV-cache slot.

    The cache is built with ``config.num_hidden_layers`` slots and the mask reads its length from the
    first one, so slot 0 must belong to an attention that still runs.
    """
    types = getattr(model.config, "layer_types", None)
    removed_attn = any(isinstance(layer.self_attn, RemovedBlock) for layer in layers)
    if removed_attn and types is not None and len(set(types)) > 1:
        raise ValueError(f"granularity: attention sub-blocks cannot be removed from a model with mixed layer_types "
                         f"{sorted(set(types))} (their KV-cache slots would change type)")
    j = 0
    for layer in layers:
        if isinstance(layer.self_attn, RemovedBlock):
            continue
        if hasattr(layer.self_attn, "layer_idx"):
            layer.self_attn.layer_idx = j
        j += 1


def remove_blocks(model: nn.Module, remove: Sequence[int], granularity: str) -> int:
    """Remove the blocks of layers ``remove`` from ``model`` in place; returns the parameters removed.

    ``layer``: the decoder layers are deleted, ``config.num_hidden_layers`` (and ``config.layer_types``,
    where the config has it) updated; the model saves and reloads with ``save_pretrained`` /
    ``from_pretrained`` as a smaller model of its class. ``attention``/``mlp``: the sub-block and its
    pre-norm are replaced by :class:`RemovedBlock` and ``nn.Identity`` (the count includes the norm's
    weight); such a model runs and generates but does not round-trip through ``from_pretrained``,
    whose config has no field for a missing sub-block.
    In every case the remaining attention modules are renumbered for the KV cache.
    """
    layers = decoder_layers(model)
    remove = sorted(set(int(i) for i in remove))
    bad = [i for i in remove if not 0 <= i < len(layers)]
    if bad:
        raise ValueError(f"remove: layer indices {bad} out of range 0..{len(layers) - 1}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity: must be one of {list(GRANULARITIES)}, got {granularity!r}")
    if granularity == "layer":
        if len(remove) == len(layers):
            raise ValueError(f"remove: cannot remove all {len(layers)} layers")
        removed = _count([layers[i] for i in remove])
        types = getattr(model.config, "layer_types", None)
        for i in reversed(remove):
            del layers[i]  # ModuleList renumbers its keys, so the state dict stays contiguous
        model.config.num_hidden_layers = len(layers)
        if types is not None:
            model.config.layer_types = [t for i, t in enumerate(types) if i not in set(remove)]
    else:
        sub, norm = ("self_attn", "input_layernorm") if granularity == "attention" else ("mlp", "post_attention_layernorm")
        already = [i for i in remove if isinstance(getattr(layers[i], sub), RemovedBlock)]
        if already:
            raise ValueError(f"remove: the {granularity} sub-blocks of layers {already} are already removed")
        removed = _count([m for i in remove for m in (getattr(layers[i], sub), getattr(layers[i], norm))])
        for i in remove:
            setattr(layers[i], sub, RemovedBlock(granularity))
            setattr(layers[i], norm, nn.Identity())
    _renumber_attention(model, layers)
    return removed


@dataclass
class PrunedModel:
    """What a block-pruning method returns: the pruned copy (eval mode), the blocks removed
    (original layer indices), the scores they were chosen by, and the parameter counts."""

    model: nn.Module
    method: str
    granularity: str
    removed: list[int]
    scores: BlockScores
    params_before: int
    params_after: int
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def params_removed(self) -> int:
        return self.params_before - self.params_after

    def meta(self) -> dict[str, Any]:
        """JSON-friendly record: method, resolved config, removed blocks, scores, parameter counts."""
        s = self.scores
        return {"method": self.method, "config": self.config, "granularity": self.granularity,
                "removed": self.removed, "scores": s.scores, "candidates": s.candidates,
                "entropy": None if s.entropy is None else {str(k): v for k, v in s.entropy.items()},
                "phase_start": s.phase_start, "params_before": self.params_before,
                "params_after": self.params_after, "params_removed": self.params_removed}


def n_params(model: nn.Module) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return _count([model])


def prune_by_scores(model: nn.Module, scores: BlockScores, cfg: BlockPruneConfig) -> PrunedModel:
    """Remove the ``cfg.n_remove`` lowest-scoring candidate blocks from a copy of ``model``."""
    remove = select_blocks(scores, cfg.n_remove)
    pruned = copy.deepcopy(model)
    before = n_params(pruned)
    removed = remove_blocks(pruned, remove, cfg.granularity)
    after = n_params(pruned)
    assert before - after == removed, (before, after, removed)
    return PrunedModel(pruned.eval(), cfg.method, cfg.granularity, remove, scores, before, after, to_dict(cfg))


@register_pruner("entrodrop", EntroDropConfig)
def entrodrop(model: nn.Module, cfg: EntroDropConfig, *, calib_tokens: np.ndarray | torch.Tensor | None) -> PrunedModel:
    """EntroDrop: remove the ``n_remove`` blocks with the smallest entropy increase in the increasing phase.

    ``model`` is left unchanged. ``calib_tokens``: a 1-D token stream or (n, T) windows.
    """
    decoder_layers(model)
    return prune_by_scores(model, entropy_scores(model, cfg, calib_tokens=calib_tokens), cfg)


@register_pruner("cosine_drop", CosineDropConfig)
def cosine_drop(model: nn.Module, cfg: CosineDropConfig, *, calib_tokens: np.ndarray | torch.Tensor | None) -> PrunedModel:
    """cosine_drop: remove the ``n_remove`` blocks with the smallest input/output angular distance."""
    decoder_layers(model)
    return prune_by_scores(model, angular_scores(model, cfg, calib_tokens=calib_tokens), cfg)
