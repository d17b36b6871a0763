"""tasks.sparse.rotation: WINA's orthogonalising transform keeps the function, orthogonalises k and gate,
makes WINA's choice optimal on them, and is undone exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from tasks.sparse.allocation import capture_blocks
from tasks.sparse.registry import sparsify
from tasks.sparse.rotation import OrthogonalRotation
from tasks.sparse.teal import topk_sparsify
from tasks.sparse.wina import WinaConfig, column_norms
from sparse_support import VOCAB, logits
from sparse_support import tiny_llama as _tiny_llama


def tiny_llama(*, tied: bool = False):
    """The tiny Llama with RMSNorm gains away from 1 (so folding them matters), optionally tied."""
    model = _tiny_llama(kv_heads=2, seed=1)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for mod in model.modules():
            if type(mod).__name__.endswith("RMSNorm"):
                mod.weight.copy_(0.5 + torch.rand(mod.weight.shape, generator=gen))
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_rotated_model_computes_the_same_function_and_is_undone_exactly(tied):
    model = tiny_llama(tied=tied)
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters(remove_duplicate=False)}
    dense = logits(model, TOKENS)
    rotation = OrthogonalRotation(model)
    with rotation:
        assert model.model.embed_tokens.weight is not model.lm_head.weight  # untied while applied
        rotated = logits(model, TOKENS)
        changed = [n for n, p in model.named_parameters(remove_duplicate=False) if not torch.equal(p, before[n][1])]
    assert torch.allclose(rotated, dense, atol=2e-4 * dense.abs().max())
    assert any("embed_tokens" in n for n in changed) and any("down_proj" in n for n in changed)
    for n, p in model.named_parameters(remove_duplicate=False):
        assert p is before[n][0] and torch.equal(p, before[n][1])
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert torch.equal(logits(model, TOKENS), dense)


def test_k_and_gate_columns_are_orthogonal_only_after_the_rotation():
    model = tiny_llama()
    layer = model.model.layers[1]

    def off_diagonal(w):
        g = w.detach().double().T @ w.detach().double()
        return float((g - torch.diag(torch.diagonal(g))).abs().max() / torch.diagonal(g).max())

    assert off_diagonal(layer.self_attn.k_proj.weight) > 0.05
    with OrthogonalRotation(model):
        for lin in (layer.self_attn.k_proj, layer.mlp.gate_proj, model.model.layers[0].self_attn.k_proj):
            assert off_diagonal(lin.weight) < 1e-5
        assert off_diagonal(layer.self_attn.q_proj.weight) > 0.05  # q shares k's input, not its rotation


def test_on_orthogonal_columns_wina_drops_the_least_output_error_teal_does_not():
    """With orthogonal columns the error of dropping a set is Σ x_i² ‖W[:, i]‖², so WINA's top-k
    is the best k of every token; TEAL's (|x| alone) is worse somewhere."""
    model = tiny_llama()
    gate = model.model.layers[0].mlp.gate_proj
    x = torch.randn(64, gate.in_features, generator=torch.Generator().manual_seed(4))
    with OrthogonalRotation(model):
        w = gate.weight.detach()
        norms = column_norms(gate)

        def err(kept):
            return ((x - kept) @ w.T).pow(2).sum(-1)

        wina_err = err(topk_sparsify(x, 0.5, norms))
        teal_err = err(topk_sparsify(x, 0.5, None))
        dropped = (x * norms) ** 2
        best = dropped.sort(-1).values[:, : x.shape[1] // 2].sum(-1)
    assert torch.allclose(wina_err, best, rtol=1e-4)
    assert bool((wina_err <= teal_err * (1 + 1e-5)).all()) and bool((wina_err < teal_err).any())


def test_wina_with_the_transform_through_the_sparsify_api():
    model = tiny_llama(tied=True)
    dense = logits(model, TOKENS)
    calib = np.random.default_rng(5).integers(0, VOCAB, 8 * 32).astype(np.int64)
    cfg = WinaConfig(transform=True, norms="gate_k", sparsities=(0.0, 0.5), calib_seq_len=32)
    with sparsify(model, cfg, sparsity=0.0) as h:  # nothing dropped: the rotated model alone
        assert torch.allclose(logits(model, TOKENS), dense, atol=2e-4 * dense.abs().max())
    assert h.meta["transform"] is True
    handle = sparsify(model, cfg, sparsity=0.5)
    assert torch.equal(logits(model, TOKENS), dense)  # building the handle leaves the model as it was
    with handle:
        sparse = logits(model, TOKENS)
    assert handle.achieved_sparsity() == pytest.approx(0.5, abs=0.02)
    assert not torch.allclose(sparse, dense, atol=1e-3)
    assert torch.equal(logits(model, TOKENS), dense) and model.lm_head.weight is model.model.embed_tokens.weight
    for targets in (WinaConfig.targets, ("*.mlp.gate_proj", "*.mlp.up_proj", "*.mlp.down_proj")):
        greedy = sparsify(model, WinaConfig(transform=True, allocation="greedy", sparsities=(0.5,), calib_seq_len=32,
                                            greedy_windows=2, targets=targets), sparsity=0.5, calib_tokens=calib)
        with greedy:
            logits(model, TOKENS)
        assert greedy.achieved_sparsity() == pytest.approx(0.5, abs=0.05)


@pytest.mark.parametrize("unit", ["model.layers.0", "model.layers.1.mlp", "model.layers.0.self_attn"])
def test_a_layer_or_branch_called_alone_gives_what_the_forward_gave_it(unit):
    """TEAL's greedy search replays one block (a decoder layer, or an MLP alone) on the inputs a full
    forward gave it: under the rotation the replay must give the same output."""
    model = tiny_llama()
    with OrthogonalRotation(model):
        args, kwargs, out = capture_blocks(model, [unit], TOKENS)[unit]
        again = model.get_submodule(unit)(*args, **kwargs)
    assert torch.allclose(again[0] if isinstance(again, tuple) else again, out, atol=1e-6)


def test_a_model_without_llama_modules_is_refused_by_name():
    with pytest.raises(ValueError, match=r"Linear has no model.embed_tokens"):
        OrthogonalRotation(nn.Linear(4, 4))
    model = tiny_llama()
    del model.model.layers[1].mlp.gate_proj
    with pytest.raises(ValueError, match=r"layers\[1\] has no mlp.gate_proj"):
        OrthogonalRotation(model)
