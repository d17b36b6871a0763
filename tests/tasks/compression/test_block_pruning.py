"""tasks.compression.block_pruning: the entropy estimators, EntroDrop and cosine_drop's choice of block,
and models that still run (with a KV cache) and reload after blocks are removed."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from tasks.compression import block_pruning as bp
from tasks.compression.block_pruning import (
    BlockScores,
    CosineDropConfig,
    EntroDropConfig,
    RemovedBlock,
    cosine_drop,
    entrodrop,
    histogram_entropy,
    knn_entropy,
    n_params,
    remove_blocks,
    select_blocks,
)

VOCAB = 256
IDENTITY = 3  # the layer made an exact identity


def tiny_llama(n_layers: int = 6, *, seed: int = 0, kv_heads: int = 2):
    """A random Llama (hidden 64, 4 heads, ``kv_heads`` KV heads), deep enough to have a middle."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=n_layers,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=128,
                      use_cache=False, tie_word_embeddings=False, initializer_range=0.1)
    return LlamaForCausalLM(cfg).eval()


def with_identity(model, layer: int, part: str = "layer"):
    """A copy whose ``layer`` adds nothing to the residual stream in its attention and/or MLP."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        if part in ("layer", "attention"):
            model.model.layers[layer].self_attn.o_proj.weight.zero_()
        if part in ("layer", "mlp"):
            model.model.layers[layer].mlp.down_proj.weight.zero_()
    return model


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def calib():
    return torch.randint(0, VOCAB, (8, 48), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def held_out():
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(2))


def logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=tokens, use_cache=False).logits


def incremental_logits(model, tokens, prefix: int):
    """Logits of ``tokens`` computed as a prefill of ``prefix`` tokens then one token at a time with a KV cache."""
    with torch.no_grad():
        out = model(input_ids=tokens[:, :prefix], use_cache=True)
        cache, steps = out.cache, [out.logits]
        for t in range(prefix, tokens.shape[1]):
            out = model(input_ids=tokens[:, t : t + 1], cache=cache, use_cache=True)
            cache = out.cache
            steps.append(out.logits)
    return torch.cat(steps, 1)


# ------------------------------------------------------------------------------------------------
# Estimators


@pytest.mark.parametrize("d,sigma,k", [(1, 1.0, 1), (3, 1.5, 5), (8, 0.3, 5)], ids=["d1-k1", "d3-k5", "d8-narrow-k5"])
def test_knn_entropy_matches_a_gaussians_analytic_entropy(d, sigma, k):
    x = sigma * torch.randn(3000, d, generator=torch.Generator().manual_seed(d))
    analytic = 0.5 * d * math.log(2 * math.pi * math.e * sigma**2)
    assert knn_entropy(x, k) == pytest.approx(analytic, abs=0.06 * d + 0.05)


def test_knn_entropy_ignores_duplicate_rows():
    x = torch.randn(500, 3, generator=torch.Generator().manual_seed(0))
    assert math.isfinite(knn_entropy(torch.cat([x, x[:50]]), 5))
    assert knn_entropy(torch.cat([x, x[:50]]), 5) == knn_entropy(x, 5)


def test_histogram_entropy_orders_a_narrow_and_a_wide_distribution():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(4000, 8, generator=g)
    narrow, wide = 0.5 * z, 2.0 * torch.randn(4000, 8, generator=g)
    assert histogram_entropy(narrow) < histogram_entropy(wide)
    # Each Gaussian marginal contributes ½ log(2πe σ²); 20 buckets over the sample range come close.
    analytic = 8 * 0.5 * math.log(2 * math.pi * math.e * 0.25)
    assert histogram_entropy(narrow) == pytest.approx(analytic, abs=0.5)
    # The public code's variant (no bucket width) sees only the shape of the marginals, not their scale,
    # but still ranks a concentrated (Gaussian) sample below a flat (uniform) one of the same range.
    assert histogram_entropy(narrow, differential=False) == pytest.approx(histogram_entropy(3 * narrow, differential=False))
    uniform = torch.rand(4000, 8, generator=g)
    assert histogram_entropy(narrow, differential=False) < histogram_entropy(uniform, differential=False)


# ------------------------------------------------------------------------------------------------
# Choosing the block


@pytest.mark.parametrize("estimator", ["knn", "histogram"])
@pytest.mark.parametrize("granularity", ["layer", "attention", "mlp"])
def test_entrodrop_picks_the_block_made_an_identity(model, calib, estimator, granularity):
    m = with_identity(model, IDENTITY, granularity)
    cfg = EntroDropConfig(n_remove=1, granularity=granularity, estimator=estimator, seq_len=48, calib_windows=8)
    pruned = entrodrop(m, cfg, calib_tokens=calib)
    assert pruned.removed == [IDENTITY]
    assert pruned.scores.scores[IDENTITY] == 0.0  # the same states in and out: the same estimate
    assert min(s for l, s in enumerate(pruned.scores.scores) if l != IDENTITY) > 0.0
    # Removing an exact identity leaves the function unchanged.
    torch.testing.assert_close(logits(pruned.model, calib[:2]), logits(m, calib[:2]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("granularity", ["layer", "attention", "mlp"])
def test_cosine_drop_picks_the_block_made_an_identity(model, calib, granularity):
    m = with_identity(model, IDENTITY, granularity)
    pruned = cosine_drop(m, CosineDropConfig(n_remove=1, granularity=granularity, seq_len=48), calib_tokens=calib)
    assert pruned.removed == [IDENTITY]
    assert pruned.scores.scores[IDENTITY] == pytest.approx(0.0, abs=1e-3)
    assert min(s for l, s in enumerate(pruned.scores.scores) if l != IDENTITY) > 0.05


def test_scores_are_reported_per_block_and_the_lowest_chosen(model, calib):
    pruned = entrodrop(model, EntroDropConfig(n_remove=2, seq_len=48), calib_tokens=calib)
    s = pruned.scores
    assert len(s.scores) == 6 and s.candidates == [0, 1, 2, 3, 4]  # keep_last=1 protects layer 5
    assert pruned.removed == sorted(sorted(s.candidates, key=lambda l: s.scores[l])[:2])
    meta = pruned.meta()
    assert meta["removed"] == pruned.removed and meta["params_removed"] == pruned.params_removed > 0
    assert len(meta["entropy"]) == 7  # layer boundaries Z_0..Z_6


def test_the_increasing_phase_excludes_blocks_before_the_entropy_minimum(model, calib, monkeypatch):
    # Entropy along the layer boundaries Z_0..Z_6 falls to its minimum at Z_2 and rises after:
    # blocks 0 and 1 lie in the decreasing phase; layer 4 adds the least inside the increasing one.
    trajectory = iter([5.0, 3.0, 1.0, 2.5, 4.0, 4.2, 6.0])
    monkeypatch.setattr(bp, "knn_entropy", lambda x, k: next(trajectory))
    cfg = EntroDropConfig(n_remove=1, seq_len=48, calib_windows=1, keep_last=0)
    scores = bp.entropy_scores(model, cfg, calib_tokens=calib)
    assert scores.phase_start == 4  # state index of Z_2
    assert scores.candidates == [2, 3, 4, 5]
    assert scores.scores[1] < 0 and select_blocks(scores, 1) == [4]
    with pytest.raises(ValueError, match="n_remove: 5 layer blocks asked for, but only 4"):
        select_blocks(scores, 5)


# ------------------------------------------------------------------------------------------------
# The pruned model


@pytest.mark.parametrize("remove", [[0], [2, 4], [5]], ids=["first", "two-middle", "last"])
def test_a_model_with_layers_removed_runs_with_a_kv_cache_and_its_config_matches(model, held_out, remove, tmp_path):
    from transformers import LlamaForCausalLM

    m = copy.deepcopy(model)
    expected_removed = sum(p.numel() for i in remove for p in model.model.layers[i].parameters())
    assert remove_blocks(m, remove, "layer") == expected_removed == n_params(model) - n_params(m)
    assert m.config.num_hidden_layers == len(m.model.layers) == 6 - len(remove)
    assert [l.self_attn.layer_idx for l in m.model.layers] == list(range(6 - len(remove)))
    full = logits(m, held_out)
    assert full.shape == (2, 24, VOCAB) and torch.isfinite(full).all()
    torch.testing.assert_close(incremental_logits(m, held_out, prefix=10), full, rtol=1e-4, atol=1e-4)
    # The config describes the pruned model: it saves and reloads as a smaller Llama.
    m.save_pretrained(tmp_path)
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.num_hidden_layers == 6 - len(remove)
    torch.testing.assert_close(logits(reloaded, held_out), full, rtol=0, atol=0)


@pytest.mark.parametrize("granularity", ["attention", "mlp"])
def test_removed_sub_blocks_keep_the_model_running_and_report_their_parameters(model, held_out, granularity):
    m = copy.deepcopy(model)
    layers = model.model.layers
    sub, norm = ("self_attn", "input_layernorm") if granularity == "attention" else ("mlp", "post_attention_layernorm")
    expected = sum(p.numel() for i in (0, 3) for mod in (getattr(layers[i], sub), getattr(layers[i], norm))
                   for p in mod.parameters())
    assert remove_blocks(m, [0, 3], granularity) == expected == n_params(model) - n_params(m)
    assert m.config.num_hidden_layers == 6 and len(m.model.layers) == 6
    assert isinstance(getattr(m.model.layers[3], sub), RemovedBlock) and isinstance(getattr(m.model.layers[3], norm), nn.Identity)
    if granularity == "attention":  # the remaining attentions own cache slots 0..3 (slot 0 is what the mask reads)
        assert [l.self_attn.layer_idx for l in m.model.layers if not isinstance(l.self_attn, RemovedBlock)] == [0, 1, 2, 3]
    full = logits(m, held_out)
    assert torch.isfinite(full).all() and not torch.allclose(full, logits(model, held_out))
    torch.testing.assert_close(incremental_logits(m, held_out, prefix=10), full, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="already removed"):
        remove_blocks(m, [3], granularity)


def test_the_original_model_is_left_unchanged(model, calib):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pruned = cosine_drop(model, CosineDropConfig(n_remove=2, seq_len=48), calib_tokens=calib)
    assert len(model.model.layers) == 6 and model.config.num_hidden_layers == 6
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert len(pruned.model.model.layers) == 4


# ------------------------------------------------------------------------------------------------
# Configuration errors


@pytest.mark.parametrize("kwargs,field", [
    ({"n_remove": 0}, "n_remove"),
    ({"estimator": "kde"}, "estimator"),
    ({"granularity": "head"}, "granularity"),
    ({"phase": "decreasing"}, "phase"),
    ({"knn_k": 0}, "knn_k"),
    ({"bins": 1}, "bins"),
    ({"skip_first_tokens": 256}, "skip_first_tokens"),
    ({"keep_last": -1}, "keep_last"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_config_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        EntroDropConfig(**kwargs)


def test_more_blocks_than_the_model_has_names_n_remove(model, calib):
    with pytest.raises(ValueError, match="^n_remove: 6 layer blocks asked for, but only 5"):
        cosine_drop(model, CosineDropConfig(n_remove=6, seq_len=48), calib_tokens=calib)


def test_a_model_without_decoder_layers_names_the_model(calib):
    with pytest.raises(ValueError, match="^model: Sequential has no decoder layers"):
        entrodrop(nn.Sequential(nn.Embedding(VOCAB, 8)), EntroDropConfig(), calib_tokens=calib)

    class Block(nn.Module):  # a decoder layer of another layout (GPT-2's attn/mlp/ln_1/ln_2)
        def __init__(self):
            super().__init__()
            self.attn, self.mlp = nn.Linear(8, 8), nn.Linear(8, 8)

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Module()
            self.model.layers = nn.ModuleList([Block(), Block()])

    with pytest.raises(ValueError, match=r"^model: decoder layer 0 \(Block\) has no \['self_attn'"):
        cosine_drop(Decoder(), CosineDropConfig(), calib_tokens=calib)


def test_no_calibration_tokens_says_what_to_set(model):
    with pytest.raises(ValueError, match="entrodrop needs calibration tokens"):
        entrodrop(model, EntroDropConfig(), calib_tokens=None)


def test_select_blocks_breaks_ties_by_layer():
    scores = BlockScores("cosine_drop", "layer", [0.5, 0.1, 0.1, 0.3], candidates=[0, 1, 2, 3])
    assert select_blocks(scores, 1) == [1] and select_blocks(scores, 3) == [1, 2, 3]
