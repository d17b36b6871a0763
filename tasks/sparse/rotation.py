"""WINA's orthogonalising transform: rotate a Llama-family model so chosen weights have orthogonal columns.

WINA (Chen, Zhao, Ko, Banbury, Zhuang, Liang & Chen 2025, "WINA: Weight Informed Neuron Activation for
Accelerating Large Language Model Inference", arXiv:2505.19427, §3.3; code microsoft/wina,
``utils/tensor_transform.py``) keeps input channel ``i`` by ``|x_i| · ‖W[:, i]‖₂``, which is the best
``k`` channels exactly when ``W``'s columns are orthogonal. As SliceGPT does (Ashkboos et al. 2024,
"SliceGPT: Compress Large Language Models by Deleting Rows and Columns", arXiv:2401.15024), RMSNorm
gains are folded into the linears they feed and the residual stream is rotated per block by the right
singular vectors of ``k_proj`` (before attention) and ``gate_proj`` (before the MLP), with the
shortcuts changing basis between the two; the rotated model computes the same function.

Deviation: the authors' LayerNorm mean-baking is left out (Llama's RMSNorm has no mean to bake, and
centring the embeddings would change an RMSNorm model's function). :class:`OrthogonalRotation` is
reversible (a context manager restoring the original parameter objects). Details: docs/sparse.md.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["OrthogonalRotation", "llama_parts"]

_BLOCK_PARTS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@dataclass
class LlamaParts:
    """The modules the rotation touches."""

    embed: nn.Embedding
    layers: list[nn.Module]
    norm: nn.Module
    head: nn.Linear


def _get(module: nn.Module, path: str) -> Any:
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def llama_parts(model: nn.Module) -> LlamaParts:
    """The embedding, decoder layers, final norm and head of a Llama-family causal LM.

    Raises ``ValueError`` naming the first missing module (e.g. for GPT-2 or xLSTM models).
    """
    name = type(model).__name__
    base = getattr(model, "model", None)
    for path in ("model.embed_tokens", "model.layers", "model.norm", "lm_head"):
        if _get(model, path) is None:
            raise ValueError(f"WINA transform: {name} has no {path}; it needs a Llama-family model "
                             "(model.embed_tokens, model.layers[*].self_attn/mlp, model.norm, lm_head)")
    layers = list(base.layers)
    for i, layer in enumerate(layers):
        for path in _BLOCK_PARTS:
            if _get(layer, path) is None:
                raise ValueError(f"WINA transform: {name}.model.layers[{i}] has no {path}")
        if getattr(_get(layer, "self_attn.o_proj"), "bias", None) is not None or \
                getattr(_get(layer, "mlp.down_proj"), "bias", None) is not None:
            raise ValueError(f"WINA transform: {name}.model.layers[{i}]: output projections with a bias are not supported")
    for norm in [base.norm] + [m for layer in layers for m in (layer.input_layernorm, layer.post_attention_layernorm)]:
        if getattr(norm, "bias", None) is not None or getattr(norm, "weight", None) is None:
            raise ValueError(f"WINA transform: {type(norm).__name__} is not an RMSNorm with a gain and no bias")
    return LlamaParts(base.embed_tokens, layers, base.norm, model.lm_head)


def _right_singular(w: torch.Tensor) -> torch.Tensor:
    """``V`` (in, in) of ``w = U Σ Vᵀ`` in float64: ``w V`` has orthogonal columns."""
    return torch.linalg.svd(w.double(), full_matrices=True).Vh.T


class OrthogonalRotation(contextlib.AbstractContextManager):
    """The rotated weights of ``model`` and the shortcut changes of basis, ready to swap in."""

    def __init__(self, model: nn.Module) -> None:
        parts = llama_parts(model)
        self._new: list[tuple[nn.Module, str, torch.Tensor]] = []  # (module, parameter name, rotated value)
        self._old: list[tuple[nn.Module, str, nn.Parameter]] = []
        self._shortcuts: list[tuple[nn.Module, torch.Tensor, torch.Tensor]] = []  # (layer, S_attn, S_mlp)
        self._forwards: list[tuple[nn.Module, Any]] = []  # (layer, its own forward attribute or None)
        with torch.no_grad():
            self._build(parts)

    def _stage(self, module: nn.Module, value: torch.Tensor) -> None:
        ref = module.weight
        self._new.append((module, "weight", value.to(dtype=ref.dtype, device=ref.device)))

    def _build(self, parts: LlamaParts) -> None:
        def folded(linear: nn.Linear, norm: nn.Module) -> torch.Tensor:
            return linear.weight.double() * norm.weight.double()[None, :]

        q_in = _right_singular(folded(parts.layers[0].self_attn.k_proj, parts.layers[0].input_layernorm))
        self._stage(parts.embed, parts.embed.weight.double() @ q_in)
        for i, layer in enumerate(parts.layers):
            attn, mlp = layer.self_attn, layer.mlp
            for lin in (attn.q_proj, attn.k_proj, attn.v_proj):
                self._stage(lin, folded(lin, layer.input_layernorm) @ q_in)
            q_mid = _right_singular(folded(mlp.gate_proj, layer.post_attention_layernorm))
            self._stage(attn.o_proj, q_mid.T @ attn.o_proj.weight.double())
            for lin in (mlp.gate_proj, mlp.up_proj):
                self._stage(lin, folded(lin, layer.post_attention_layernorm) @ q_mid)
            if i + 1 < len(parts.layers):
                nxt = parts.layers[i + 1]
                q_out = _right_singular(folded(nxt.self_attn.k_proj, nxt.input_layernorm))
            else:
                q_out = q_mid
            self._stage(mlp.down_proj, q_out.T @ mlp.down_proj.weight.double())
            dtype = layer.input_layernorm.weight.dtype
            self._shortcuts.append((layer, (q_in.T @ q_mid).to(dtype), (q_mid.T @ q_out).to(dtype)))
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                self._new.append((norm, "weight", torch.ones_like(norm.weight)))
            q_in = q_out
        self._stage(parts.head, folded(parts.head, parts.norm) @ q_in)
        self._new.append((parts.norm, "weight", torch.ones_like(parts.norm.weight)))

    # --- applying -------------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        return bool(self._old or self._forwards)

    def apply(self) -> OrthogonalRotation:
        """Swap the rotated weights and the layers' shortcut forwards in; the model computes the same function."""
        if self._old or self._forwards:
            raise RuntimeError("this rotation is already applied")
        try:
            for module, name, value in self._new:
                self._old.append((module, name, module._parameters[name]))
                module._parameters[name] = nn.Parameter(value, requires_grad=False)
            for layer, s_attn, s_mlp in self._shortcuts:
                self._patch_forward(layer, s_attn, s_mlp)
        except BaseException:
            self.revert()
            raise
        return self

    def _patch_forward(self, layer: nn.Module, s_attn: torch.Tensor, s_mlp: torch.Tensor) -> None:
        """Run ``layer`` as Llama's decoder layer does, with the residual carried into each branch's
        output basis: ``h = x S_attn + attn(norm(x))``, ``out = h S_mlp + mlp(norm(h))``. An
        instance attribute shadows the class's ``forward``; the branches and norms stay the model's
        own modules, so hooks on them and calls of them alone (TEAL's greedy search) are unchanged."""

        def forward(self: nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    position_ids: torch.Tensor | None = None, cache: Any = None, use_cache: bool | None = False,
                    position_embeddings: Any = None, **kwargs: Any) -> torch.Tensor:
            if cache is None:
                cache = kwargs.pop("past_key_values", None)
            h, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask,
                                  position_ids=position_ids, cache=cache, use_cache=use_cache,
                                  position_embeddings=position_embeddings, **kwargs)
            h = hidden_states @ s_attn.to(hidden_states.dtype) + h
            return h @ s_mlp.to(h.dtype) + self.mlp(self.post_attention_layernorm(h))

        self._forwards.append((layer, layer.__dict__.get("forward")))
        layer.forward = types.MethodType(forward, layer)

    def revert(self) -> None:
        """Restore the layers' forwards and the original parameter objects (re-tying a tied head)."""
        for layer, previous in reversed(self._forwards):
            if previous is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = previous
        self._forwards.clear()
        for module, name, param in reversed(self._old):
            module._parameters[name] = param
        self._old.clear()

    def __enter__(self) -> OrthogonalRotation:
        return self.apply()

    def __exit__(self, *exc: object) -> None:
        self.revert()
