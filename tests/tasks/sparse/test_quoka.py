"""tasks.sparse.quoka: QuoKA's key selection, the reversible attention patch, exactness at budget 1."""

from __future__ import annotations

import math

import pytest
import torch

from tasks.common.config import ConfigError
from tasks.sparse.quoka import QuokaConfig, earlier_keep_share, quoka, quoka_select
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
    # one keep share per forward pass meets the target over the whole pass (up to rounding of B per chunk)
    assert handle.achieved_sparsity() == pytest.approx(0.75, abs=0.02)


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

    from tasks.lm.loss import evaluate_loss

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


@pytest.mark.parametrize("sparsity", [0.5, 0.88], ids=["s50", "s88"])
@pytest.mark.parametrize("chunk_size", [16, 40], ids=["chunk16", "chunk40"])
def test_every_query_attends_to_its_own_chunk_up_to_itself(model, sparsity, chunk_size):
    """With values one-hot in the key position, the output row of a query is its attention over
    keys. Each query must see itself and the earlier keys of its own chunk (chunked prefill appends
    the chunk's keys; QuoKA subselects the earlier ones) and the sink. The first version shared one
    selection over every visible key with the chunk and masked it causally, so a query whose own key
    scored low lost it: most queries at 88%."""
    n, g = 160, torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 4, n, n, generator=g), torch.randn(1, 2, n, n, generator=g)
    v = torch.eye(n).expand(1, 2, n, n)
    handle = quoka(model, QuokaConfig(sparsities=(sparsity,), chunk_size=chunk_size, min_keys=4), sparsity=sparsity)
    probs = handle.attend(handle, q, k, v, None, n ** -0.5).transpose(1, 2)  # (b, h_q, query, key)
    pos = torch.arange(n)
    own_chunk = (pos[None, :] <= pos[:, None]) & (pos[None, :] // chunk_size == pos[:, None] // chunk_size)
    assert (probs[..., own_chunk] > 0).all()
    assert (probs[..., 0] > 0).all()  # the sink
    assert (probs[..., pos[None, :] > pos[:, None]] == 0).all()  # causal
    later = pos >= 2 * chunk_size  # chunks with enough earlier keys to choose from
    assert ((probs[0, :, later] > 0).float().sum(-1) < pos[later] + 1).all()  # and they do skip some
    if earlier_keep_share(n, n, chunk_size, sparsity, 4) > 0:  # the target is reachable: met
        assert handle.achieved_sparsity() == pytest.approx(sparsity, abs=0.03)
    else:  # diagonal blocks and floor alone hold more than 1 - sparsity of the pairs: falls short
        assert 0 < handle.achieved_sparsity() < sparsity


@pytest.mark.parametrize("q_len,chunk,sparsity", [(1024, 128, 0.5), (1024, 32, 0.88), (500, 63, 0.75), (96, 16, 0.6)],
                         ids=["1024-c128-s50", "1024-c32-s88", "500-c63-s75", "96-c16-s60"])
def test_keep_share_meets_the_pair_budget_with_the_diagonal_counted(q_len, chunk, sparsity):
    phi = earlier_keep_share(q_len, q_len, chunk, sparsity, 8)
    visible, kept = q_len * (q_len + 1) // 2, 0.0
    for s in range(0, q_len, chunk):
        c = min(chunk, q_len - s)
        kept += c * (c + 1) / 2 + min(s, max(min(s, 8), phi * s)) * c
    assert 0 < phi < 1 and kept / visible == pytest.approx(1 - sparsity, rel=1e-6)


def test_keep_share_is_zero_when_the_diagonal_alone_exceeds_the_budget():
    # chunks of 128 on 1024 tokens: the diagonal blocks hold 12.6% of the causal pairs
    assert earlier_keep_share(1024, 1024, 128, 0.9, 0) == 0.0
    assert earlier_keep_share(100, 100, 128, 0.5, 0) == 1.0  # one chunk: nothing earlier to choose from
