"""tasks.sparse.quoka: QuoKA's key selection, the reversible attention patch, exactness at budget 1."""

from __future__ import annotations

import math

import pytest
import torch

from tasks.common.config import ConfigError
from tasks.sparse.quoka import QuokaConfig, quoka, quoka_select
from tasks.sparse.registry import parse_settings, sparsify
from sparse_support import VOCAB
from sparse_support import logits as _logits
from sparse_support import tiny_llama as _tiny_llama



def tiny_llama(kv_heads: int = 2, seed: int = 0):
    return _tiny_llama(kv_heads=kv_heads, seed=seed)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, VOCAB, (2, 96), generator=torch.Generator().manual_seed(5))



def test_sparsity_zero_is_exact_attention_and_the_patch_is_undone(model, tokens):
    dense = _logits(model, tokens)
    impl = model.config._attn_implementation
    with quoka(model, QuokaConfig(sparsities=(0.0,), chunk_size=16), sparsity=0.0) as handle:
        assert model.config._attn_implementation != impl
        patched = _logits(model, tokens)
    assert model.config._attn_implementation == impl
    assert torch.allclose(patched, dense, atol=1e-5)
    assert handle.achieved_sparsity() == 0.0
    assert torch.equal(_logits(model, tokens), dense)  # nothing left behind


def test_sparsity_skips_pairs_and_changes_outputs(model, tokens):
    dense = _logits(model, tokens)
    with quoka(model, QuokaConfig(sparsities=(0.75,), chunk_size=16, min_keys=4), sparsity=0.75) as handle:
        sparse = _logits(model, tokens)
    assert torch.isfinite(sparse).all()
    assert not torch.allclose(sparse, dense, atol=1e-4)
    # the early chunks see few keys and keep min_keys of them: achieved is below, not above, the target
    assert 0.4 < handle.achieved_sparsity() <= 0.75


def test_the_patch_is_undone_when_the_block_raises(model, tokens):
    impl = model.config._attn_implementation
    with pytest.raises(RuntimeError, match="boom"):
        with quoka(model, QuokaConfig(sparsities=(0.5,)), sparsity=0.5):
            raise RuntimeError("boom")
    assert model.config._attn_implementation == impl


def test_selection_probes_with_the_query_the_mean_represents_worst():
    """Seven queries of a head point along u, one along w: the probe is the w query, so the key along
    w is kept and the key along u (which the mean query would pick) is not."""
    d, n = 16, 40
    u, w = torch.zeros(d), torch.zeros(d)
    u[0], w[1] = 1.0, 1.0
    g = torch.Generator().manual_seed(0)
    q = (u + 0.05 * torch.randn(1, 1, 8, d, generator=g))
    q[0, 0, 5] = w * 3
    k = 0.05 * torch.randn(1, 1, n, d, generator=g)
    k[0, 0, 17], k[0, 0, 30] = w, u
    keep = quoka_select(q, k, 3, n_queries=1, aggregate="max")
    assert keep.shape == (1, 1, 3)
    assert keep[0, 0, 0] == 0  # the sink, then increasing order
    assert 17 in keep[0, 0].tolist() and 30 not in keep[0, 0].tolist()
    assert (keep.diff(dim=-1) > 0).all()


def test_a_gqa_group_shares_its_keys():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 8, 16, generator=g)
    k = torch.randn(2, 2, 30, 16, generator=g)
    keep = quoka_select(q, k, 6, n_queries=2, aggregate="mean")
    assert keep.shape == (2, 2, 6)  # one key set per kv head, shared by its two query heads


def test_gqa_one_kv_head_per_query_head_works_too(tokens):
    model = tiny_llama(kv_heads=4)
    with quoka(model, QuokaConfig(sparsities=(0.5,), chunk_size=32), sparsity=0.5) as handle:
        out = _logits(model, tokens)
    assert torch.isfinite(out).all() and handle.achieved_sparsity() > 0


def test_registry_and_params_errors():
    parsed = parse_settings({"q": {"method": "quoka", "sparsities": [0.5, 0.88], "chunk_size": 64}}, "sparse_eval.yaml")
    assert parsed["q"][0] == "quoka" and parsed["q"][1].chunk_size == 64
    with pytest.raises(ConfigError, match=r"sparse_eval\.settings\.q\.chunk_size: must be >= 1"):
        parse_settings({"q": {"method": "quoka", "chunk_size": 0}}, "sparse_eval.yaml")
    with pytest.raises(ConfigError, match=r"aggregate: expected one of"):
        parse_settings({"q": {"method": "quoka", "aggregate": "sum"}}, "sparse_eval.yaml")


def test_a_model_without_attention_modules_is_refused():
    with pytest.raises(ValueError, match="no Llama-family attention modules"):
        sparsify(torch.nn.Sequential(torch.nn.Linear(4, 4)), QuokaConfig(sparsities=(0.5,)), sparsity=0.5)


def test_evaluate_loss_runs_under_the_patch(model):
    import numpy as np

    from tasks.evaluation.loss import evaluate_loss

    val = np.random.default_rng(0).integers(0, VOCAB, 1 + 4 * 64).astype(np.int64)
    dense = evaluate_loss(model, val, 64, 4)
    with quoka(model, QuokaConfig(sparsities=(0.5,), chunk_size=16), sparsity=0.5):
        sparse = evaluate_loss(model, val, 64, 4)
    assert math.isfinite(sparse) and sparse != dense


def test_padding_mask_is_honoured(model, tokens):
    mask = torch.ones_like(tokens)
    mask[1, 70:] = 0  # right padding on the second row
    with torch.no_grad():
        dense = model(input_ids=tokens, attention_mask=mask).logits
        with quoka(model, QuokaConfig(sparsities=(0.0,), chunk_size=16), sparsity=0.0):
            same = model(input_ids=tokens, attention_mask=mask).logits
        with quoka(model, QuokaConfig(sparsities=(0.5,), chunk_size=16), sparsity=0.5):
            sparse = model(input_ids=tokens, attention_mask=mask).logits
    assert torch.allclose(same[1, :70], dense[1, :70], atol=1e-5) and torch.allclose(same[0], dense[0], atol=1e-5)
    assert torch.isfinite(sparse[1, :70]).all()
