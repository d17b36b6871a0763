"""tasks.sparse.wina and tasks.sparse.allocation: WINA's criterion, its two variants, TEAL's greedy allocation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from tasks.common.config import ConfigError
from tasks.sparse.allocation import block_of, effective_sparsity, greedy_levels
from tasks.sparse.registry import parse_settings, sparsify
from tasks.sparse.teal import TealConfig, teal_sites, topk_sparsify
from tasks.sparse.wina import ALL_LINEARS, WinaConfig, column_norms, wina, wina_scales
from sparse_support import VOCAB
from sparse_support import tiny_llama as _tiny_llama



def tiny_llama(kv_heads: int = 2, seed: int = 0):
    return _tiny_llama(kv_heads=kv_heads, seed=seed)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def calib():
    return np.random.default_rng(3).integers(0, VOCAB, 8 * 32).astype(np.int64)


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(7))


def _inputs_seen(model, tokens, handle):
    """What each site received under ``handle``."""
    seen = {}
    with torch.no_grad(), handle:  # registered after the handle's hooks, so they see what those pass on
        hooks = [m.register_forward_pre_hook(lambda mod, a, n=n: seen.__setitem__(n, a[0].detach().clone()))
                 for n, (m, _) in handle.sites.items()]
        try:
            model(input_ids=tokens)
        finally:
            for h in hooks:
                h.remove()
    return seen


# --- the criterion ---------------------------------------------------------------------------


def test_wina_minimises_the_output_error_when_columns_are_orthogonal():
    """W = Q diag(c): dropping channel i costs x_i² c_i², so WINA's top-k is the best k-subset; TEAL's is not."""
    g = torch.Generator().manual_seed(0)
    d, out = 48, 64
    q, _ = torch.linalg.qr(torch.randn(out, d, generator=g))
    c = torch.exp(torch.randn(d, generator=g))  # column norms spread over ~e^±2
    w = q * c
    assert torch.allclose(column_norms(_lin(w)), c, rtol=1e-5)
    x = torch.randn(200, d, generator=g)
    for s in (0.25, 0.5, 0.65):
        err_wina = (x @ w.t() - topk_sparsify(x, s, c) @ w.t()).norm(dim=-1)
        err_teal = (x @ w.t() - topk_sparsify(x, s) @ w.t()).norm(dim=-1)
        assert (err_wina <= err_teal + 1e-5).all()
        assert err_wina.mean() < 0.9 * err_teal.mean()
        # and it is the optimum: the error is the dropped channels' x_i^2 c_i^2
        drop = topk_sparsify(x, s, c) == 0
        assert torch.allclose(err_wina ** 2, ((x * c) ** 2 * drop).sum(-1), rtol=1e-4, atol=1e-5)


def _lin(w):
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    return lin


def test_equal_column_norms_make_wina_teal():
    x = torch.randn(4, 9, 40, generator=torch.Generator().manual_seed(1))
    assert torch.equal(topk_sparsify(x, 0.5, torch.full((40,), 3.0)), topk_sparsify(x, 0.5))


def test_every_linear_of_each_block_is_a_site_by_default(model):
    sites = teal_sites(model, WinaConfig().targets)
    assert len(sites) == 2 * len(ALL_LINEARS)
    assert {block_of(n) for n in sites} == {"model.layers.0", "model.layers.1"}


@pytest.mark.parametrize("sparsity", [0.25, 0.4, 0.5, 0.65])
def test_topk_keeps_the_top_scores_of_each_site(model, tokens, sparsity):
    handle = wina(model, WinaConfig(sparsities=(sparsity,)), sparsity=sparsity)
    seen = _inputs_seen(model, tokens, handle)
    dense = _inputs_seen(model, tokens, sparsify(model, TealConfig(targets=ALL_LINEARS, sparsities=(0.0,)), sparsity=0.0))
    for name, mod in handle.sites.items():
        d = seen[name].shape[-1]
        n_drop = math.floor(sparsity * d + 0.5)
        # inputs downstream of earlier sparse sites differ from the dense ones; the mask is on what arrived
        assert ((seen[name] == 0).sum(-1) >= n_drop).all()
    q0 = "model.layers.0.self_attn.q_proj"  # the first site sees the dense input: check the kept set
    score = dense[q0].abs() * column_norms(handle.sites[q0][0])
    kept = seen[q0] != 0
    k = seen[q0].shape[-1] - math.floor(sparsity * seen[q0].shape[-1] + 0.5)
    top = torch.zeros_like(kept).scatter(-1, torch.topk(score, k, dim=-1).indices, True)
    assert torch.equal(kept, top)
    assert handle.achieved_sparsity() == pytest.approx(sparsity, abs=0.02)


def test_code_variant_uses_column_norms_for_gate_and_k_only(model):
    sites = teal_sites(model, ALL_LINEARS)
    scales = wina_scales(sites, "gate_k")
    with_norms = sorted(n.rsplit(".", 1)[1] for n, c in scales.items() if c is not None)
    assert with_norms == ["gate_proj", "gate_proj", "k_proj", "k_proj"]
    assert all(c is not None for c in wina_scales(sites, "all").values())


def test_threshold_mode_calibrates_on_the_scores(model, calib, tokens):
    cfg = WinaConfig(mode="threshold", sparsities=(0.5,), calib_seq_len=32)
    handle = wina(model, cfg, sparsity=0.5, calib_tokens=calib)
    assert set(handle.meta["thresholds"]) == set(handle.sites)
    with torch.no_grad(), handle:
        model(input_ids=tokens)
    assert handle.achieved_sparsity() == pytest.approx(0.5, abs=0.1)


def test_wina_settings_parse_and_bad_values_name_the_key():
    parsed = parse_settings({"w": {"method": "wina", "norms": "gate_k", "sparsities": [0.25, 0.5]}}, "sparse_eval.yaml")
    assert parsed["w"][0] == "wina" and parsed["w"][1].norms == "gate_k"
    with pytest.raises(ConfigError, match=r"sparse_eval\.settings\.w\.norms: expected one of"):
        parse_settings({"w": {"method": "wina", "norms": "some"}}, "sparse_eval.yaml")
    with pytest.raises(ConfigError, match=r"sparsities: each must be in \[0, 1\)"):
        parse_settings({"w": {"method": "wina", "sparsities": [1.2]}}, "sparse_eval.yaml")


# --- greedy allocation -----------------------------------------------------------------------


def test_greedy_lands_each_block_on_the_target(model, calib):
    cfg = TealConfig(allocation="greedy", sparsities=(0.5,), calib_seq_len=32, greedy_windows=2)
    handle = sparsify(model, cfg, sparsity=0.5, calib_tokens=calib)
    levels = handle.meta["levels"]
    weights = {n: float(m.weight.numel()) for n, (m, _) in handle.sites.items()}
    for block in ("model.layers.0", "model.layers.1"):
        mine = {n: v for n, v in levels.items() if n.startswith(block + ".")}
        assert effective_sparsity(mine, weights) == pytest.approx(0.5, abs=1e-6)
        assert all(0 <= v <= cfg.greedy_max_level for v in mine.values())
    # what ran skips that share of weight reads (columns weighted by their length), up to top-k rounding
    with torch.no_grad(), handle:
        model(input_ids=torch.from_numpy(calib[:64].reshape(2, 32)))
    assert handle.achieved_sparsity() == pytest.approx(0.5, abs=0.01)


def test_greedy_piles_sparsity_on_the_sites_that_cost_nothing(calib):
    """With o_proj scaled to ~0 the attention sub-block adds ~nothing to the block's output, whatever
    q, k, v, o receive: greedy spends the whole budget there and leaves the MLP dense, which uniform
    allocation cannot do."""
    model = tiny_llama(seed=1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(1e-4)
    sites = teal_sites(model, ALL_LINEARS)
    windows = torch.from_numpy(calib[: 2 * 32].reshape(2, 32))
    levels, trace = greedy_levels(model, sites, windows, lambda n, s: (lambda x: topk_sparsify(x, s)), 0.25,
                                  step=0.05, max_level=0.9)
    weights = {n: float(m.weight.numel()) for n, m in sites.items()}
    for i in (0, 1):
        mine = {n: v for n, v in levels.items() if n.startswith(f"model.layers.{i}.")}
        assert effective_sparsity(mine, weights) == pytest.approx(0.25, abs=1e-6)
        assert all(v == 0 for n, v in mine.items() if ".mlp." in n), mine
        assert len(trace.states[f"model.layers.{i}"]) >= 10


def test_greedy_beats_uniform_on_the_block_error_it_minimises(model, calib):
    from tasks.sparse.allocation import _block_error, capture_blocks

    sites = teal_sites(model, ALL_LINEARS)
    windows = torch.from_numpy(calib[: 2 * 32].reshape(2, 32))
    make = lambda n, s: (lambda x: topk_sparsify(x, s))  # noqa: E731
    levels, path = greedy_levels(model, sites, windows, make, 0.4, step=0.1)
    # one path serves every lower level: it passes through the 0.2 allocation on its way
    low = path.levels(0.2)
    assert effective_sparsity({n: v for n, v in low.items() if n.startswith("model.layers.0.")}, path.weights) == pytest.approx(0.2)
    io = capture_blocks(model, ["model.layers.0"], windows)
    args, kwargs, ref = io["model.layers.0"]
    block = model.model.layers[0]

    def err(lv):
        from tasks.sparse.registry import ActivationSparsity

        fns = {n: (m, make(n, lv[n])) for n, m in sites.items() if n.startswith("model.layers.0.")}
        with torch.no_grad(), ActivationSparsity(model, fns):
            out = block(*args, **kwargs)
        return _block_error(out[0] if isinstance(out, tuple) else out, ref, 0.25)

    assert err(levels) < err({n: 0.4 for n in sites})


def test_greedy_needs_calibration_tokens(model):
    with pytest.raises(ValueError, match="needs calib_tokens"):
        wina(model, WinaConfig(allocation="greedy", sparsities=(0.5,)), sparsity=0.5)


def test_a_sweep_computes_the_greedy_path_once(calib, monkeypatch):
    import tasks.sparse.teal as teal

    model = tiny_llama(seed=2)
    calls = []
    real = teal.greedy_path
    monkeypatch.setattr(teal, "greedy_path", lambda *a, **k: calls.append(a[4]) or real(*a, **k))
    cfg = TealConfig(allocation="greedy", sparsities=(0.25, 0.5), calib_seq_len=32, greedy_windows=1)
    low = sparsify(model, cfg, sparsity=0.25, calib_tokens=calib).meta["levels"]
    high = sparsify(model, cfg, sparsity=0.5, calib_tokens=calib).meta["levels"]
    assert calls == [0.5]  # run once, to the sweep's highest level
    assert all(high[n] >= low[n] for n in low)
    with torch.no_grad():  # new weights: a new path
        model.model.layers[0].mlp.up_proj.weight.mul_(2)
    sparsify(model, cfg, sparsity=0.25, calib_tokens=calib)
    assert calls == [0.5, 0.5]


def test_achieved_sparsity_counts_weight_reads():
    """Each zero input entry skips one weight column, ``out_features`` reads: a narrow input into many
    outputs weighs more per entry than a wide input into few."""
    from tasks.sparse.registry import ActivationSparsity

    narrow, wide = nn.Linear(4, 100), nn.Linear(100, 4)
    model = nn.Sequential(narrow, nn.ReLU(), wide)
    h = ActivationSparsity(model, {"0": (narrow, lambda x: torch.zeros_like(x)), "2": (wide, lambda x: x)})
    with torch.no_grad(), h:
        model(torch.randn(3, 4))
    wide_zeros = h.per_site()["2"] * 300  # ReLU(bias): some of the wide input is zero as well
    assert h.per_site()["0"] == 1.0
    assert h.achieved_sparsity() == pytest.approx((12 * 100 + wide_zeros * 4) / (12 * 100 + 300 * 4))
