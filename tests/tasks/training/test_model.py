from __future__ import annotations

import pytest
import torch

from tasks.training.config import ModelShape
from tasks.training.model import (build_model, count_non_embedding_params, model_flops_per_token,
                                  non_embedding_params, peak_flops)

SHAPE = ModelShape(d_model=64, n_layers=2, n_heads=4)


def llama_non_embedding(shape: ModelShape) -> int:
    d, f, kv = shape.d_model, shape.intermediate_size, shape.kv_heads * shape.head_dim
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * f + 2 * d  # q,o + k,v + SwiGLU + 2 RMSNorm gains
    return shape.n_layers * per_layer + d  # + final norm


def test_same_seed_same_weights_and_rng_untouched():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_model(SHAPE, 256, 32, seed=7)
    after = torch.rand(1)
    b = build_model(SHAPE, 256, 32, seed=7)
    c = build_model(SHAPE, 256, 32, seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.self_attn.q_proj.weight"], sc["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(before, after)  # build_model forks the global RNG


@pytest.mark.parametrize("shape", [
    SHAPE, ModelShape(d_model=96, n_layers=3, n_heads=4), ModelShape(d_model=128, n_layers=1, n_heads=8, n_kv_heads=2),
], ids=["d64", "d96", "gqa"])
def test_non_embedding_params_matches_formula(shape):
    model = build_model(shape, 300, 32)
    n = non_embedding_params(model)
    assert n == llama_non_embedding(shape)
    total = sum(p.numel() for p in model.parameters())
    assert total == n + 2 * 300 * shape.d_model  # untied embedding + head
    assert count_non_embedding_params(shape, 300) == n


def test_forward_shape_and_untied_head():
    model = build_model(SHAPE, 256, 32)
    assert model.get_input_embeddings().weight is not model.get_output_embeddings().weight
    out = model(input_ids=torch.zeros(2, 17, dtype=torch.long), use_cache=False).logits
    assert out.shape == (2, 17, 256)


def test_flops_per_token():
    f = model_flops_per_token(SHAPE, 128, 512)
    assert f.dense == 6 * llama_non_embedding(SHAPE)
    assert f.attention == 6 * 2 * 128 * 64
    assert f.lm_head == 6 * 64 * 512
    assert f.total == f.dense + f.attention + f.lm_head
    assert peak_flops("cpu") is None


def test_xlstm_builds_and_trains_one_step():
    shape = ModelShape(d_model=64, n_layers=1, n_heads=4)
    model = build_model(shape, 256, 32, arch="xlstm", seed=0)
    x = torch.randint(0, 256, (2, 32))
    logits = model(input_ids=x, use_cache=False).logits
    assert logits.shape == (2, 32, 256)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), x.reshape(-1))
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert non_embedding_params(model) == count_non_embedding_params(shape, 256, "xlstm", 32)
    assert model_flops_per_token(shape, 32, 256, "xlstm").attention == 0.0
