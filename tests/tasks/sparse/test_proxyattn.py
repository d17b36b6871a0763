"""tasks.sparse.proxyattn: proxy-ranked block selection, per-head budgets, the reversible patch."""

from __future__ import annotations

import math

import pytest
import torch

from tasks.common.config import ConfigError
from tasks.sparse.proxyattn import (ProxyAttnConfig, candidate_keep_share, dynamic_budgets, proxyattn,
                                    proxyattn_select)
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


def causal_pairs(n: int) -> int:
    return n * (n + 1) // 2


def test_sparsity_zero_is_exact_attention_and_the_patch_is_undone(model, tokens):
    dense = _logits(model, tokens)
    impl = model.config._attn_implementation
    with proxyattn(model, ProxyAttnConfig(sparsities=(0.0,), block_size=16), sparsity=0.0) as handle:
        assert model.config._attn_implementation != impl
        patched = _logits(model, tokens)
    assert model.config._attn_implementation == impl
    assert torch.allclose(patched, dense, atol=1e-5)
    assert handle.achieved_sparsity() == 0.0
    assert torch.equal(_logits(model, tokens), dense)  # nothing left behind


def test_the_patch_is_undone_when_the_block_raises(model, tokens):
    impl = model.config._attn_implementation
    dense = _logits(model, tokens)
    with pytest.raises(RuntimeError, match="boom"):
        with proxyattn(model, ProxyAttnConfig(sparsities=(0.5,), block_size=8), sparsity=0.5):
            raise RuntimeError("boom")
    assert model.config._attn_implementation == impl
    assert torch.equal(_logits(model, tokens), dense)


# The patched attention runs Triton's interpreter on CPU (25-70 s a case on 2 cores): make test keeps the odd
# block size (6, 60%); the other targets are -m slow.
slow = pytest.mark.slow


@pytest.mark.parametrize(("block_size", "sparsity"), [pytest.param(4, 0.5, id="b4-s50", marks=slow),
                                                      pytest.param(4, 0.75, id="b4-s75", marks=slow),
                                                      pytest.param(8, 0.5, id="b8-s50", marks=slow),
                                                      pytest.param(6, 0.6, id="b6-s60")])
def test_achieved_sparsity_meets_the_target(model, tokens, block_size, sparsity):
    dense = _logits(model, tokens)
    cfg = ProxyAttnConfig(sparsities=(sparsity,), block_size=block_size)
    with proxyattn(model, cfg, sparsity=sparsity) as handle:
        sparse = _logits(model, tokens)
    assert torch.isfinite(sparse).all() and not torch.allclose(sparse, dense, atol=1e-4)
    assert handle.achieved_sparsity() == pytest.approx(sparsity, abs=0.02)


def test_an_unreachable_target_keeps_only_sink_diagonal_and_floor(model, tokens):
    """96 tokens in blocks of 16: query block i keeps the sink, its diagonal block and min_blocks=1 ranked
    block (from i = 2 on) — 2,560 + 1,536 of 4,656 pairs — and nothing else, whatever the target."""
    with proxyattn(model, ProxyAttnConfig(sparsities=(0.88,), block_size=16), sparsity=0.88) as handle:
        _logits(model, tokens)
    assert candidate_keep_share(96, 96, 16, 0.88, 1) == 0.0
    kept = 6 * causal_pairs(16) + 5 * 16 * 16 + 4 * 16 * 16
    assert handle.achieved_sparsity() == pytest.approx(1 - kept / causal_pairs(96), abs=1e-9)


def test_keep_share_is_one_when_there_is_nothing_to_choose():
    assert candidate_keep_share(32, 32, 16, 0.9) == 1.0  # sink and diagonal are all there is


def _select(q, k, *, block_size=8, keep_share=0.0, group_size=2, budget_from="head", mask=None):
    cfg = ProxyAttnConfig(sparsities=(0.5,), block_size=block_size, budget_from=budget_from)
    return proxyattn_select(q, k, cfg, group_size=group_size, keep_share=keep_share,
                            scaling=q.shape[-1] ** -0.5, mask=mask)


def kept_sets(keep: torch.Tensor) -> list[list[set[int]]]:
    return [[{int(i) for i in row if i >= 0} for row in head] for head in keep]


@pytest.mark.parametrize("n", [64, 63, 71], ids=["n64", "n63", "n71"])
def test_sink_and_diagonal_blocks_are_always_kept(n):
    """Keys of the sink and diagonal blocks point away from every query, yet every head keeps them."""
    g = torch.Generator().manual_seed(2)
    c, d, bs = 8, 16, 8
    q = torch.randn(2, 4, c, d, generator=g) + 2.0
    k = torch.randn(2, 2, n, d, generator=g)
    first_diag = (n - c) // bs
    k[:, :, :bs] -= 10.0
    k[:, :, first_diag * bs:] -= 10.0
    keep = _select(q, k, keep_share=0.0)
    assert keep.shape[:2] == (2, 4)
    forced = set(range(bs)) | set(range(first_diag * bs, n))
    for row in kept_sets(keep):
        for head in row:
            assert forced <= head
            assert len(head - forced) == bs  # the floor: one ranked block of 8 keys
    valid = keep >= 0
    assert (valid[..., :-1] >= valid[..., 1:]).all()  # padding only at the end
    ordered = torch.where(valid, keep, torch.iinfo(keep.dtype).max)
    assert (ordered.diff(dim=-1)[valid[..., 1:]] > 0).all()


def test_a_block_holding_all_the_proxy_mass_is_chosen_for_every_head_of_the_group():
    """Head 0 looks at key block 3, head 1 (same group) at block 5; their mean-pooled proxy puts all its
    mass on block 3, so both heads take block 3 first, and the group's heads rank blocks alike."""
    d, bs, n, c = 16, 8, 64, 8
    u, w = torch.zeros(d), torch.zeros(d)
    u[0], w[1] = 1.0, 1.0
    g = torch.Generator().manual_seed(3)
    q = 0.05 * torch.randn(1, 4, c, d, generator=g)
    q[0, 0] += 8 * u
    q[0, 1] += 2 * w
    q[0, 2:] += 8 * u
    k = 0.05 * torch.randn(1, 2, n, d, generator=g)
    k[0, :, 3 * bs:4 * bs] += 6 * u
    k[0, :, 5 * bs:6 * bs] += 6 * w
    block3, block5 = set(range(3 * bs, 4 * bs)), set(range(5 * bs, 6 * bs))
    sets = kept_sets(_select(q, k, keep_share=0.2))[0]
    assert all(block3 <= s for s in sets)
    assert not block5 <= sets[1] or len(sets[1]) > len(sets[0])  # block 5 only after block 3
    assert sets[0] <= sets[1] or sets[1] <= sets[0]  # one ranking per group: prefixes of it
    # without pooling (a group of one) head 1 ranks by its own scores and takes block 5 first
    alone = kept_sets(_select(q, k, keep_share=0.2, group_size=1))[0]
    assert block5 <= alone[1]


def test_dynamic_budgets_give_the_spread_out_head_more_blocks():
    sharp = torch.tensor([0.85, 0.02, 0.02, 0.02, 0.02, 0.02, 0.02, 0.02])
    flat = torch.full((8,), 0.11)
    mass = torch.stack([sharp, flat])[None]  # (1, 2, 8) in rank order
    forced = torch.tensor([[0.01, 0.12]])
    counts = dynamic_budgets(mass, forced, total=8, n_min=1, n_max=8)
    assert counts.sum() == 8 and counts[0, 0] < counts[0, 1]
    assert counts[0, 0] >= 1  # the floor
    capped = dynamic_budgets(mass, forced, total=8, n_min=1, n_max=5)
    assert capped.tolist() == [[3, 5]]  # the ceiling moves the rest to the sharp head
    # a common coverage: no other split of the 8 blocks leaves the worse-covered head better covered
    cover = (forced[..., None] + mass.cumsum(-1))[0]
    best = max(min(cover[0, a - 1], cover[1, 8 - a - 1]) for a in range(1, 8))
    assert min(cover[0, counts[0, 0] - 1], cover[1, counts[0, 1] - 1]) == best


def test_padding_mask_is_honoured(model, tokens):
    mask = torch.ones_like(tokens)
    mask[1, 70:] = 0  # right padding on the second row
    with torch.no_grad():
        dense = model(input_ids=tokens, attention_mask=mask).logits
        with proxyattn(model, ProxyAttnConfig(sparsities=(0.0,), block_size=8), sparsity=0.0):
            same = model(input_ids=tokens, attention_mask=mask).logits
        with proxyattn(model, ProxyAttnConfig(sparsities=(0.5,), block_size=8), sparsity=0.5):
            sparse = model(input_ids=tokens, attention_mask=mask).logits
    assert torch.allclose(same[1, :70], dense[1, :70], atol=1e-5) and torch.allclose(same[0], dense[0], atol=1e-5)
    assert torch.isfinite(sparse[1, :70]).all()


def test_left_padding_gives_padded_keys_no_proxy_mass():
    """Padded keys (mask -inf) in block 2 would win the ranking on their scores; the mask removes them."""
    d, bs, n, c = 16, 8, 64, 8
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, c, d, generator=g)
    k = 0.05 * torch.randn(1, 1, n, d, generator=g)
    k[0, 0, 2 * bs:3 * bs] = 5 * q[0, :, -1].mean(0)
    mask = torch.zeros(1, 1, c, n)
    mask[..., 2 * bs:3 * bs] = torch.finfo(torch.float32).min
    unmasked = kept_sets(_select(q, k, keep_share=0.0))[0]
    masked = kept_sets(_select(q, k, keep_share=0.0, mask=mask))[0]
    block2 = set(range(2 * bs, 3 * bs))
    assert all(block2 <= s for s in unmasked) and not any(block2 <= s for s in masked)


@pytest.mark.parametrize(("kv_heads", "group_size", "pooling", "budget_from"),
                         [pytest.param(2, None, "mean", "head", id="gqa-group"),
                          pytest.param(2, 4, "max", "head", id="two-kv-heads-pooled-max", marks=slow),
                          pytest.param(4, None, "mean", "proxy", id="mha-per-head", marks=slow),
                          pytest.param(1, 2, "mean", "proxy", id="mqa-half-groups")])
def test_group_and_pooling_settings_run(tokens, kv_heads, group_size, pooling, budget_from):
    model = tiny_llama(kv_heads=kv_heads)
    cfg = ProxyAttnConfig(sparsities=(0.5,), block_size=8, group_size=group_size, pooling=pooling,
                          budget_from=budget_from)
    with proxyattn(model, cfg, sparsity=0.5) as handle:
        out = _logits(model, tokens)
    assert torch.isfinite(out).all() and handle.achieved_sparsity() == pytest.approx(0.5, abs=0.03)


@pytest.mark.slow  # ~190 s on 2 cores; evaluate_loss under a patch is fast in test_quoka, the proxyattn patch above
def test_evaluate_loss_runs_under_the_patch(model):
    import numpy as np

    from tasks.lm.loss import evaluate_loss

    val = np.random.default_rng(0).integers(0, VOCAB, 1 + 4 * 64).astype(np.int64)
    dense = evaluate_loss(model, val, 64, 4)
    with proxyattn(model, ProxyAttnConfig(sparsities=(0.5,), block_size=4), sparsity=0.5) as handle:
        sparse = evaluate_loss(model, val, 64, 4)
    assert math.isfinite(sparse) and sparse != dense
    assert handle.achieved_sparsity() == pytest.approx(0.5, abs=0.02)


def test_registry_and_params_errors():
    parsed = parse_settings({"p": {"method": "proxyattn", "sparsities": [0.5, 0.88], "block_size": 4}},
                            "sparse_eval.yaml")
    assert parsed["p"][0] == "proxyattn" and parsed["p"][1].block_size == 4 and parsed["p"][1].group_size is None
    with pytest.raises(ConfigError, match=r"sparse_eval\.settings\.p\.block_size: must be >= 1"):
        parse_settings({"p": {"method": "proxyattn", "block_size": 0}}, "sparse_eval.yaml")
    with pytest.raises(ConfigError, match=r"sparse_eval\.settings\.p\.sparsities: each must be in \[0, 1\)"):
        parse_settings({"p": {"method": "proxyattn", "sparsities": [0.5, 1.0]}}, "sparse_eval.yaml")
    with pytest.raises(ConfigError, match=r"pooling: expected one of"):
        parse_settings({"p": {"method": "proxyattn", "pooling": "sum"}}, "sparse_eval.yaml")
    with pytest.raises(ConfigError, match=r"ceiling_ratio: must be >= 1"):
        parse_settings({"p": {"method": "proxyattn", "ceiling_ratio": 0.5}}, "sparse_eval.yaml")


@pytest.mark.parametrize(("changes", "sparsity", "field"),
                         [({}, 1.0, "sparsity"), ({}, -0.1, "sparsity"), ({"group_size": 3}, 0.5, "group_size"),
                          ({"block_size": 128}, 0.5, "block_size"), ({"block_size": 64, "min_blocks": 3}, 0.5,
                                                                      "block_size")],
                         ids=["sparsity-1", "sparsity-negative", "group-not-dividing-heads",
                              "block-over-context", "floor-over-context"])
def test_bad_settings_raise_naming_the_field(model, changes, sparsity, field):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        proxyattn(model, ProxyAttnConfig(sparsities=(0.5,), **changes), sparsity=sparsity)


def test_a_model_without_attention_modules_is_refused():
    with pytest.raises(ValueError, match="no Llama-family attention modules"):
        sparsify(torch.nn.Sequential(torch.nn.Linear(4, 4)), ProxyAttnConfig(sparsities=(0.5,)), sparsity=0.5)


def test_a_continuation_on_a_kv_cache_is_exact_at_sparsity_zero_and_counts_its_pairs(model, tokens):
    """Queries after a cached prefix (q_len < k_len, the scoring path of the evaluate stage)."""
    with torch.no_grad():
        full = model(input_ids=tokens).logits
        for sparsity in (0.0, 0.5):
            with proxyattn(model, ProxyAttnConfig(sparsities=(sparsity,), block_size=8), sparsity=sparsity) as handle:
                prefix = model(input_ids=tokens[:, :61], use_cache=True)
                rest = model(input_ids=tokens[:, 61:], cache=prefix.cache, use_cache=True).logits
            n_layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
            assert handle.visible == n_layers * tokens.shape[0] * heads * causal_pairs(tokens.shape[1])
            if sparsity == 0:
                assert torch.allclose(rest, full[:, 61:], atol=1e-5)
            else:
                assert torch.isfinite(rest).all() and 0.4 < handle.achieved_sparsity() <= 0.5


@pytest.mark.parametrize(("nq", "n", "budget_from", "proxy_queries"),
                         [(61, 61, "head", None), (40, 75, "head", 3), (37, 37, "proxy", None), (29, 50, "proxy", 2)],
                         ids=["prefill", "cached-prefix-pq3", "proxy-budget", "cached-proxy-pq2"])
def test_all_blocks_at_once_equal_one_block_at_a_time(nq, n, budget_from, proxy_queries):
    """proxyattn_blocks scores every query block in passes over the keys the pass's last query sees;
    each block's lists must be those it gets scored alone over exactly its visible keys."""
    from tasks.sparse.proxyattn import proxyattn_blocks

    g = torch.Generator().manual_seed(nq)
    q, k = torch.randn(1, 4, nq, 16, generator=g), torch.randn(1, 2, n, 16, generator=g)
    mask = torch.zeros(1, 1, nq, n)
    mask[..., :3] = -math.inf  # left padding
    cfg = ProxyAttnConfig(sparsities=(0.5,), block_size=4, budget_from=budget_from, proxy_queries=proxy_queries)
    kw = dict(group_size=2, keep_share=0.3, scaling=0.25, mask=mask)
    whole, dense = proxyattn_blocks(q, k, cfg, rows_per_pass=8, **kw)
    assert torch.equal(whole, proxyattn_blocks(q, k, cfg, rows_per_pass=1024, **kw)[0])
    offset = n - nq
    for i in range(-(-nq // 4)):
        s, e = 4 * i, min(4 * i + 4, nq)
        alone, one_dense = proxyattn_blocks(q[:, :, s:e], k[:, :, : offset + e], cfg, group_size=2, keep_share=0.3,
                                            scaling=0.25, mask=mask[:, :, s:e, : offset + e])
        assert one_dense == [dense[i]]
        got = [{int(x) for x in row if x >= 0} for row in whole[0, :, i]]
        assert got == [{int(x) for x in row if x >= 0} for row in alone[0, :, 0]], i


def test_proxy_queries_choose_which_queries_score_the_proxy():
    """All of a block's queries = the default; one query ranks blocks by that query's scores alone."""
    from tasks.sparse.proxyattn import proxyattn_blocks

    d, bs, n = 16, 8, 64
    g = torch.Generator().manual_seed(6)
    q = 0.05 * torch.randn(1, 2, bs, d, generator=g)
    k = 0.05 * torch.randn(1, 1, n, d, generator=g)
    k[0, 0, 2 * bs:3 * bs, 0] = 6.0  # block 2 answers the block's first queries, block 4 its last one
    k[0, 0, 4 * bs:5 * bs, 1] = 6.0
    q[0, :, :-1, 0] = 3.0
    q[0, :, -1, 1] = 3.0
    kw = dict(group_size=2, keep_share=0.0, scaling=0.25)  # the floor: one ranked block per head

    def ranked(proxy_queries):
        cfg = ProxyAttnConfig(sparsities=(0.5,), block_size=bs, budget_from="proxy", proxy_queries=proxy_queries)
        blocks = proxyattn_blocks(q, k, cfg, **kw)[0]
        return {int(x) for x in blocks[0, 0, 0]} - {0, n // bs - 1}

    assert ranked(None) == ranked(bs) == {2}
    assert ranked(1) == {4}
    with pytest.raises(ValueError, match="proxy_queries: must be >= 1"):
        ProxyAttnConfig(sparsities=(0.5,), proxy_queries=0)
