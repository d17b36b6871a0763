"""GradPruner: gradient-guided layer pruning with sign-consistent merging.

Follows Huang, Cheng & Wang, "GradPruner: Gradient-guided Layer Pruning Enabling Efficient
Fine-Tuning and Inference for LLMs" (ICLR 2026; public code secretflow/ACoLab, PaperCode/GradPrune):
accumulate each weight's squared (or absolute) gradient over the first ``steps`` fine-tuning steps
(the IGIA-Matrix), remove the ``n_remove`` layers with the smallest sums, and add each removed
layer's top-``density`` weights into the neighbouring kept layer where the signs agree.

Deviations: full fine-tuning of the decoder layers' linear weights (embeddings, head and norms
frozen, as LoRA leaves them) with their true gradients, where the paper simulates the frozen
weight's gradient from LoRA's adapters; where the paper is silent (merge direction, several layers
merging into one, ``merge_scale``, biases, norms, which weights the pruned model starts from) the
choice is a config field. Details: docs/pruning.md.

>>> pruned = gradpruner(model, GradPrunerConfig(n_remove=2), calib_tokens=tokens)   # doctest: +SKIP
>>> pruned.removed, pruned.merged_into                                              # doctest: +SKIP
([17, 21], {17: 16, 21: 20})
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tasks.common.config import at_least, require, to_dict
from tasks.common.registry import MethodSpec
from tasks.compression._calib import calibration_windows, model_seq_len
from tasks.compression.block_pruning import (
    BlockScores,
    PrunedModel,
    decoder_layers,
    n_params,
    remove_blocks,
    select_blocks,
)
from tasks.compression.registry import register_pruner

ACCUMULATIONS = ("squared", "abs")
MERGE_DIRECTIONS = ("previous", "next")
WEIGHT_SOURCES = ("original", "finetuned")


@dataclass(frozen=True, kw_only=True)
class GradPrunerConfig(MethodSpec):
    """GradPruner. ``n_remove`` decoder layers are removed, never the first ``keep_first`` nor the
    last ``keep_last``. The IGIA-Matrix comes from ``steps`` AdamW steps (``lr``, ``weight_decay``)
    of next-token loss on batches of ``batch_size`` of ``calib_windows`` windows of ``seq_len``
    tokens, drawn in a shuffled order fixed by ``seed``; ``accumulate``: ``squared`` (the paper's
    mean squared gradient) or ``abs``. ``density``: the fraction of each pruned weight's elements
    (top by IGIA) offered for merging, 0 = none; ``merge_scale``: ``λ``; ``merge_into``:
    ``previous`` or ``next`` kept layer; ``weights``: build the pruned model from the ``original``
    or the ``finetuned`` weights. See the module docstring for which of these the paper fixes."""

    method: Literal["gradpruner"] = "gradpruner"
    n_remove: int = 1
    keep_first: int = 0
    keep_last: int = 1
    steps: int = 4
    lr: float = 1e-5
    weight_decay: float = 0.0
    batch_size: int = 2
    calib_windows: int = 8
    seq_len: int = 256
    accumulate: Literal["squared", "abs"] = "squared"
    density: float = 0.1
    merge_scale: float = 1.0
    merge_into: Literal["previous", "next"] = "previous"
    weights: Literal["original", "finetuned"] = "original"
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least(self.n_remove, 1, "n_remove")
        at_least(self.keep_first, 0, "keep_first")
        at_least(self.keep_last, 0, "keep_last")
        at_least(self.steps, 1, "steps")
        at_least(self.lr, 0, "lr")
        at_least(self.weight_decay, 0, "weight_decay")
        at_least(self.batch_size, 1, "batch_size")
        at_least(self.calib_windows, 1, "calib_windows")
        at_least(self.seq_len, 2, "seq_len")
        require(self.accumulate in ACCUMULATIONS, "accumulate",
                f"must be one of {list(ACCUMULATIONS)}, got {self.accumulate!r}")
        require(0.0 <= self.density <= 1.0, "density", f"must be in [0, 1], got {self.density}")
        require(self.merge_scale > 0, "merge_scale", f"must be > 0, got {self.merge_scale}")
        require(self.merge_into in MERGE_DIRECTIONS, "merge_into",
                f"must be one of {list(MERGE_DIRECTIONS)}, got {self.merge_into!r}")
        require(self.weights in WEIGHT_SOURCES, "weights",
                f"must be one of {list(WEIGHT_SOURCES)}, got {self.weights!r}")


# ---------------------------------------------------------------------------------------------
# IGIA-Matrix


def layer_linear_parameters(layer: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters of the ``nn.Linear`` sub-modules of one decoder layer, by name within the layer
    (``self_attn.q_proj.weight``, ..., and biases where the model has them)."""
    return {f"{name}.{pname}": p for name, mod in layer.named_modules() if isinstance(mod, nn.Linear)
            for pname, p in mod.named_parameters(recurse=False)}


@dataclass
class IGIA:
    """The IGIA-Matrices of a model: ``matrices[l][name]`` (same shape as the parameter, float32, on
    the model's device) for every linear parameter ``name`` of decoder layer ``l``; ``losses``: the
    next-token loss of each fine-tuning step's batch before its update; ``finetuned``: the copy after
    the steps (kept only when asked for)."""

    matrices: list[dict[str, torch.Tensor]]
    losses: list[float]
    accumulate: str
    finetuned: nn.Module | None = None

    def layer_scores(self) -> list[float]:
        """``S_l = Σ_W Σ_ij F_W[i, j]`` per decoder layer (float64 sums)."""
        return [float(sum(m.double().sum() for m in layer.values())) for layer in self.matrices]


def next_token_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting ``x[:, 1:]`` from ``x[:, :-1]``'s logits, ``x`` (B, T) int64."""
    logits = model(input_ids=x, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def igia_matrices(model: nn.Module, cfg: GradPrunerConfig, *, calib_tokens: np.ndarray | torch.Tensor | None,
                  keep_finetuned: bool = False) -> IGIA:
    """Fine-tune a copy of ``model`` for ``cfg.steps`` AdamW steps and accumulate the IGIA-Matrices.

    Only the decoder layers' linear parameters train (the rest is frozen, as under LoRA); ``model``
    is left unchanged. ``calib_tokens``: a 1-D token stream or (n, T) windows. With
    ``accumulate="squared"`` the result is ``(1/t) Σ_i g_i ⊙ g_i``, ``g_i`` the gradient of step
    ``i``'s batch at the weights before that step's update.
    """
    decoder_layers(model)
    windows = calibration_windows(calib_tokens, model_seq_len(model, cfg.seq_len), cfg.calib_windows,
                                  method=cfg.method)
    work = copy.deepcopy(model)
    layers = decoder_layers(work)
    for p in work.parameters():
        p.requires_grad_(False)
    params = [layer_linear_parameters(layer) for layer in layers]
    trainable = [p for layer in params for p in layer.values()]
    if not trainable:
        raise ValueError(f"model: {type(model).__name__}'s decoder layers have no nn.Linear sub-modules")
    for p in trainable:
        p.requires_grad_(True)
    acc = [{n: torch.zeros_like(p, dtype=torch.float32) for n, p in layer.items()} for layer in params]
    opt = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
    device = next(work.parameters()).device
    gen = torch.Generator().manual_seed(cfg.seed)
    order = torch.empty(0, dtype=torch.long)
    losses = []
    work.train()
    for _ in range(cfg.steps):
        if len(order) < min(cfg.batch_size, len(windows)):
            order = torch.cat([order, torch.randperm(len(windows), generator=gen)])
        idx, order = order[: cfg.batch_size], order[cfg.batch_size :]
        loss = next_token_loss(work, windows[idx].to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        with torch.no_grad():
            for layer, sums in zip(params, acc):
                for n, p in layer.items():
                    g = p.grad.float()
                    sums[n] += g * g if cfg.accumulate == "squared" else g.abs()
        opt.step()
        losses.append(float(loss.detach()))
    for sums in acc:
        for t in sums.values():
            t /= cfg.steps
    work.eval()
    for p in work.parameters():
        p.requires_grad_(True)
    return IGIA(acc, losses, cfg.accumulate, work if keep_finetuned else None)


# ---------------------------------------------------------------------------------------------
# Sparsify and merge


def top_density_mask(importance: torch.Tensor, density: float) -> torch.Tensor:
    """Boolean mask of the ``round(density · numel)`` largest entries of ``importance`` (ties: the
    first in flattened order)."""
    k = int(round(density * importance.numel()))
    mask = torch.zeros(importance.numel(), dtype=torch.bool, device=importance.device)
    if k > 0:
        # A stable sort, so a tie at the threshold keeps the earlier element, whatever the platform.
        order = torch.sort(importance.reshape(-1).float(), descending=True, stable=True).indices
        mask[order[:k]] = True
    return mask.view(importance.shape)


def sign_consistent_merge(kept: torch.Tensor, pruned: torch.Tensor, importance: torch.Tensor, density: float,
                          scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """GradPruner's merge of one weight: ``W_k + λ · M_sign ⊙ M_top ⊙ W_p`` and the mask merged.

    ``kept`` (the kept layer's weight), ``pruned`` and ``importance`` (the pruned weight's IGIA
    matrix) share one shape. ``M_top``: the top ``density`` fraction of ``importance``
    (:func:`top_density_mask`); ``M_sign``: ``sign(W_p) = sign(W_k)``, both non-zero. Returns
    ``(merged, mask)``; ``merged`` is a new tensor in ``kept``'s dtype.

    >>> kept = torch.tensor([[1., -2.], [3., .5]]); pruned = torch.tensor([[.5, .7], [-1., .2]])
    >>> merged, mask = sign_consistent_merge(kept, pruned, torch.tensor([[4., 3.], [2., 1.]]), 0.75)
    >>> merged                   # (0,1) and (1,0) disagree in sign, (1,1) is outside the top 75%
    tensor([[ 1.5000, -2.0000],
            [ 3.0000,  0.5000]])
    """
    if not (kept.shape == pruned.shape == importance.shape):
        raise ValueError(f"kept, pruned, importance: shapes differ ({tuple(kept.shape)}, {tuple(pruned.shape)}, "
                         f"{tuple(importance.shape)})")
    top = top_density_mask(importance, density)
    agree = (torch.sign(pruned) == torch.sign(kept)) & (pruned != 0)
    mask = top & agree
    merged = kept + (scale * pruned * mask).to(kept.dtype)
    return merged, mask


def merge_targets(n_layers: int, removed: Sequence[int], direction: str = "previous") -> dict[int, int]:
    """The kept layer each removed layer merges into: the nearest kept layer before it (``previous``)
    or after it (``next``), the other side when there is none."""
    gone = set(removed)
    kept = [l for l in range(n_layers) if l not in gone]
    if not kept:
        raise ValueError(f"removed: all {n_layers} layers removed, none left to merge into")
    out = {}
    for l in sorted(gone):
        before = [k for k in kept if k < l]
        after = [k for k in kept if k > l]
        if direction == "previous":
            out[l] = before[-1] if before else after[0]
        else:
            out[l] = after[0] if after else before[-1]
    return out


# ---------------------------------------------------------------------------------------------
# The method


@dataclass
class GradPrunedModel(PrunedModel):
    """:class:`~tasks.compression.block_pruning.PrunedModel` plus GradPruner's merge record:
    ``merged_into`` (removed layer -> kept layer, original indices), ``merged_elements`` (removed
    layer -> elements added into the kept layer), ``offered_elements`` (removed layer -> elements
    in the top-density masks), ``finetune_losses`` (loss of each IGIA step)."""

    merged_into: dict[int, int] = field(default_factory=dict)
    merged_elements: dict[int, int] = field(default_factory=dict)
    offered_elements: dict[int, int] = field(default_factory=dict)
    finetune_losses: list[float] = field(default_factory=list)

    def meta(self) -> dict[str, Any]:
        return super().meta() | {
            "merged_into": {str(k): v for k, v in self.merged_into.items()},
            "merged_elements": {str(k): v for k, v in self.merged_elements.items()},
            "offered_elements": {str(k): v for k, v in self.offered_elements.items()},
            "finetune_losses": self.finetune_losses,
        }


@register_pruner("gradpruner", GradPrunerConfig)
def gradpruner(model: nn.Module, cfg: GradPrunerConfig, *, calib_tokens: np.ndarray | torch.Tensor | None) -> GradPrunedModel:
    """GradPruner: remove the ``n_remove`` layers of lowest IGIA score, each merged (sparsified,
    same-sign elements only) into its neighbouring kept layer.

    ``model`` is left unchanged; the result's ``model`` is a copy with ``L - n_remove`` layers that
    runs, caches and reloads like the original class (``save_pretrained`` / ``from_pretrained``).
    ``calib_tokens``: a 1-D token stream or (n, T) windows.
    """
    layers = decoder_layers(model)
    igia = igia_matrices(model, cfg, calib_tokens=calib_tokens, keep_finetuned=cfg.weights == "finetuned")
    n = len(layers)
    candidates = [l for l in range(n) if cfg.keep_first <= l < n - cfg.keep_last]
    scores = BlockScores(cfg.method, "layer", igia.layer_scores(), candidates)
    remove = select_blocks(scores, cfg.n_remove)
    targets = merge_targets(n, remove, cfg.merge_into)

    pruned = igia.finetuned if cfg.weights == "finetuned" else copy.deepcopy(model)
    work_layers = decoder_layers(pruned)
    merged, offered = {}, {}
    if cfg.density > 0:
        with torch.no_grad():
            for p in remove:
                into = layer_linear_parameters(work_layers[targets[p]])
                src = layer_linear_parameters(work_layers[p])
                merged[p] = offered[p] = 0
                for name, w_p in src.items():
                    w_k = into[name]
                    new, mask = sign_consistent_merge(w_k, w_p, igia.matrices[p][name], cfg.density, cfg.merge_scale)
                    w_k.copy_(new)
                    merged[p] += int(mask.sum())
                    offered[p] += int(round(cfg.density * w_p.numel()))
    before = n_params(pruned)
    removed = remove_blocks(pruned, remove, "layer")
    after = n_params(pruned)
    assert before - after == removed, (before, after, removed)
    return GradPrunedModel(pruned.eval(), cfg.method, "layer", remove, scores, before, after, to_dict(cfg),
                           merged_into=targets if cfg.density > 0 else {}, merged_elements=merged,
                           offered_elements=offered, finetune_losses=igia.losses)
