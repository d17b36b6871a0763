"""tasks.sparse.teal and tasks.sparse.registry: TEAL's masks, achieved sparsity, hooks, params."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from kernels.sparse_gemv import sparse_gemv
from tasks.common.config import ConfigError
from tasks.common.params import PRESETS, load_stage_config
from tasks.sparse.registry import SparseEvalConfig, SparseMethodSpec, get_sparsifier, parse_settings, sparsify
from sparse_support import HIDDEN, INTER, VOCAB
from sparse_support import logits as _logits
from sparse_support import tiny_llama as _tiny_llama
from tasks.sparse.teal import TealConfig, teal, teal_sites, threshold_sparsify, topk_sparsify

ROOT = Path(__file__).resolve().parents[3]
LEVELS = [0.25, 0.5, 0.65]


def tiny_llama(kv_heads: int = 4, seed: int = 0):
    return _tiny_llama(kv_heads=kv_heads, seed=seed)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, VOCAB, (4, 64), generator=torch.Generator().manual_seed(7))



# --- the mask --------------------------------------------------------------------------------


@pytest.mark.parametrize("sparsity", [0.0, 0.25, 0.5, 0.65, 0.99])
@pytest.mark.parametrize("d", [1, 63, 128, 500])
def test_topk_mask_is_exact_per_token(d, sparsity):
    x = torch.randn(5, 3, d, generator=torch.Generator().manual_seed(d))
    y = topk_sparsify(x, sparsity)
    n_drop = math.floor(sparsity * d + 0.5)
    zeroed = y == 0
    assert (zeroed.sum(-1) == n_drop).all()  # exactly that many per token (no zeros in x)
    assert torch.equal(y[~zeroed], x[~zeroed])  # survivors untouched
    if 0 < n_drop < d:
        kept_min = torch.where(zeroed, torch.inf, x.abs()).amin(-1)
        dropped_max = torch.where(zeroed, x.abs(), -torch.inf).amax(-1)
        assert (kept_min >= dropped_max).all()  # the largest magnitudes are the ones kept


def test_threshold_mask_is_the_kernels_mask():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(4, 63, generator=g), torch.randn(50, 63, generator=g)
    for t in (0.0, 0.5, 1.2):
        y = threshold_sparsify(x, t) @ w.t()
        torch.testing.assert_close(y, sparse_gemv(x, w, threshold=t), rtol=1e-5, atol=1e-5)


# --- hooks on a model ------------------------------------------------------------------------


def test_sites_are_the_mlp_projections(model):
    sites = teal_sites(model, TealConfig().targets)
    assert list(sites) == [f"model.layers.{i}.mlp.{p}" for i in range(2) for p in ("gate_proj", "up_proj", "down_proj")]
    with pytest.raises(ValueError, match="match no nn.Linear"):
        teal_sites(model, ("*.does_not_exist",))


def test_sparsity_zero_leaves_outputs_identical(model, tokens):
    dense = _logits(model, tokens)
    with teal(model, TealConfig(), sparsity=0.0) as handle:
        assert torch.equal(_logits(model, tokens), dense)
    assert handle.achieved_sparsity() == 0.0


@pytest.mark.parametrize("sparsity", LEVELS)
def test_topk_achieved_sparsity_matches_target(model, tokens, sparsity):
    with teal(model, TealConfig(), sparsity=sparsity) as handle:
        _logits(model, tokens)
    per_site = handle.per_site()
    assert len(per_site) == 6
    for name, achieved in per_site.items():
        d = INTER if name.endswith("down_proj") else HIDDEN
        assert achieved == pytest.approx(math.floor(sparsity * d + 0.5) / d, abs=1e-12), name
    # Overall: element-weighted over sites, within rounding of the target.
    assert abs(handle.achieved_sparsity() - sparsity) <= 1 / (2 * HIDDEN)


def test_down_proj_receives_the_topk_of_its_dense_input(model, tokens):
    down = model.model.layers[1].mlp.down_proj
    seen = {}
    # Registered before TEAL's hook: sees the input as the MLP produced it ...
    before = down.register_forward_pre_hook(lambda m, a: seen.__setitem__("in", a[0].clone()))
    try:
        with teal(model, TealConfig(), sparsity=0.5):
            # ... and this one, registered after, sees what TEAL hands to the matmul.
            after = down.register_forward_pre_hook(lambda m, a: seen.__setitem__("out", a[0].clone()))
            _logits(model, tokens)
            after.remove()
    finally:
        before.remove()
    assert torch.equal(seen["out"], topk_sparsify(seen["in"], 0.5))
    assert ((seen["out"] == 0).sum(-1) == INTER // 2).all()


def test_hooks_are_removed_on_exit_and_on_error(model, tokens):
    dense = _logits(model, tokens)
    handle = teal(model, TealConfig(), sparsity=0.65)
    with pytest.raises(RuntimeError, match="boom"):
        with handle:
            assert not torch.equal(_logits(model, tokens), dense)
            raise RuntimeError("boom")
    assert not handle.active
    assert torch.equal(_logits(model, tokens), dense)
    assert all(not m._forward_pre_hooks for m in model.modules())


def _kl_from_dense(model, tokens, dense_logp, handle):
    with handle:
        logq = _logits(model, tokens).float().log_softmax(-1)
    return (dense_logp.exp() * (dense_logp - logq)).sum(-1).mean().item()


def test_more_sparsity_costs_more(model, tokens):
    dense_logp = _logits(model, tokens).float().log_softmax(-1)
    kls = [_kl_from_dense(model, tokens, dense_logp, teal(model, TealConfig(), sparsity=s)) for s in LEVELS]
    assert 0 < kls[0] < kls[1] < kls[2]


# --- calibrated thresholds -------------------------------------------------------------------


def test_calibrated_thresholds_hit_the_target_on_held_out_tokens(model):
    rng = np.random.default_rng(0)
    calib = rng.integers(0, VOCAB, 2048)
    held_out = torch.from_numpy(rng.integers(0, VOCAB, (4, 64)))
    cfg = TealConfig(mode="threshold", calib_seq_len=64, calib_batch_size=8)
    previous = None
    for s in LEVELS:
        handle = teal(model, cfg, sparsity=s, calib_tokens=calib)
        thresholds = handle.meta["thresholds"]
        for layer in range(2):
            p = f"model.layers.{layer}.mlp."
            assert thresholds[p + "gate_proj"] == thresholds[p + "up_proj"]  # one input, one threshold
        if previous is not None:
            assert all(thresholds[k] > previous[k] for k in thresholds)
        previous = thresholds
        with handle:
            _logits(model, held_out)
        assert abs(handle.achieved_sparsity() - s) < 0.05, (s, handle.per_site())


def test_threshold_mode_needs_calibration_tokens(model):
    with pytest.raises(ValueError, match="calib_tokens"):
        teal(model, TealConfig(mode="threshold"), sparsity=0.5)


def test_counts_accumulate_until_reset(model, tokens):
    handle = teal(model, TealConfig(), sparsity=0.5)
    assert handle.achieved_sparsity() is None  # nothing seen: missing, not 0
    with handle:
        _logits(model, tokens)
    with handle:
        _logits(model, tokens)
    assert handle.achieved_sparsity() == pytest.approx(0.5)
    handle.reset_counts()
    assert handle.achieved_sparsity() is None


# --- registry and params ---------------------------------------------------------------------


def test_registry_finds_teal_and_dispatches(model, tokens):
    assert get_sparsifier("teal").fn is teal
    handle = sparsify(model, TealConfig(sparsities=(0.5,)), sparsity=0.5)
    with handle:
        _logits(model, tokens)
    assert handle.achieved_sparsity() == pytest.approx(0.5)


@pytest.mark.parametrize("preset", PRESETS)
def test_params_file_loads_under_every_preset(preset):
    cfg = load_stage_config(SparseEvalConfig, ROOT, "sparse_eval", preset)
    methods = cfg.methods()
    assert methods and all(isinstance(c, SparseMethodSpec) for _, c in methods.values())
    assert "teal" in methods


def test_demo_sweeps_two_levels_and_ci_one():
    demo = load_stage_config(SparseEvalConfig, ROOT, "sparse_eval", "demo").methods()
    ci = load_stage_config(SparseEvalConfig, ROOT, "sparse_eval", "ci").methods()
    assert demo["teal"][1].sparsities == (0.5, 0.65) and demo["teal"][1].mode == "topk"
    assert demo["teal_calibrated"][1].mode == "threshold"
    assert list(ci) == ["teal"] and ci["teal"][1].sparsities == (0.5,)


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ({"method": "teal", "sparsities": [1.0]}, r"sparsities: each must be in \[0, 1\)"),
        ({"method": "teal", "mode": "oracle"}, r"sparse_eval\.settings\.t\.mode: expected one of"),
        ({"method": "teal", "allocation": "best"}, r"allocation: expected one of \['uniform', 'greedy'\]"),
        ({"method": "teal", "sparsities": [0.5, 0.96]}, r"greedy_max_level: must lie between the highest sparsity"),
        ({"method": "teal", "sparsity": [0.5]}, r"unknown key 'sparsity' for TealConfig"),
    ],
    ids=["level_1", "bad_mode", "bad_allocation", "max_level_below_sparsity", "misspelt_key"],
)
def test_settings_errors_name_the_key(entry, match):
    with pytest.raises(ConfigError, match=match):
        parse_settings({"t": entry}, "sparse_eval.yaml")
