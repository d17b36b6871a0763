"""tasks.compression.inhernet: full rank reproduces the teacher, a rank-r layer is the SVD truncation
for any gate, budgets are met and ranks grow with them, the inherited model evaluates, trains,
saves, reloads and multiplies back into a plain Llama."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tasks.compression.block_pruning import n_params
from tasks.compression.distill import DistillConfig, recover
from tasks.compression.inhernet import (
    InherLinear,
    InherNetConfig,
    factor_cost,
    inher_linears,
    inherit_linear,
    inhernet,
    load_inhernet,
    save_inhernet,
    thin_svd,
    to_dense,
)
from tasks.lm.loss import evaluate_loss
from tests.tasks.compression.test_block_pruning import VOCAB, incremental_logits, logits, tiny_llama

FRACTIONS = [0.2, 0.3, 0.45, 0.6, 0.8]


@pytest.fixture(scope="module")
def teacher():
    return tiny_llama()


@pytest.fixture(scope="module")
def held_out():
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(2))


def tied_llama():
    """A tiny Llama whose output head shares the embedding matrix (as SmolLM2's does)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      use_cache=False, tie_word_embeddings=True, initializer_range=0.1)
    return LlamaForCausalLM(cfg).eval()


# ------------------------------------------------------------------------------------------------
# Inheritance is exact at full rank, the SVD truncation below it


@pytest.mark.parametrize("heads,sigma", [(1, "up"), (3, "up"), (2, "sqrt")], ids=["h1-up", "h3-up", "h2-sqrt"])
def test_full_rank_reproduces_the_teachers_logits(teacher, held_out, heads, sigma):
    inh = inhernet(teacher, InherNetConfig(rank=64, heads=heads, sigma=sigma))
    assert set(inh.ranks.values()) == {32, 64}  # k/v projections are 64 -> 32: full rank is 32
    assert all(e == pytest.approx(1.0) for e in inh.energy.values())
    assert len(inher_linears(inh.model)) == 6 * 7
    torch.testing.assert_close(logits(inh.model, held_out), logits(teacher, held_out), rtol=0, atol=1e-4)
    # And with a KV cache, token by token.
    torch.testing.assert_close(incremental_logits(inh.model, held_out, prefix=7), logits(teacher, held_out),
                               rtol=0, atol=1e-4)


@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("shape,rank", [((63, 17), 5), ((40, 100), 11)], ids=["63x17-r5", "40x100-r11"])
def test_a_rank_r_layer_is_the_best_rank_r_approximation_for_any_gate(shape, rank, heads):
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(shape[1], shape[0], bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(shape, generator=g))
        lin.bias.copy_(torch.randn(shape[0], generator=g))
    layer = inherit_linear(lin, rank, heads, generator=torch.Generator().manual_seed(1))
    assert n_params(layer) == factor_cost(shape[1], shape[0], rank, heads, True)
    u, s, vh = torch.linalg.svd(lin.weight.detach().double(), full_matrices=False)
    w_r = (u[:, :rank] * s[:rank]) @ vh[:rank]
    x = torch.randn(7, 3, shape[1], generator=g)
    want = (x.double() @ w_r.T + lin.bias.double()).float()
    torch.testing.assert_close(layer(x), want, rtol=1e-4, atol=1e-4)
    if heads == 1:  # Eckart–Young: the residual's energy is that of the dropped singular values
        err = (lin.weight.detach().double() - layer.dense_weight().detach().double()).pow(2).sum()
        assert float(err) == pytest.approx(float(s[rank:].pow(2).sum()), rel=1e-4)
    else:  # the gate really depends on the input, yet every mixture gives W_r x at initialisation
        gates = torch.softmax(layer.gate(layer.down(x)), -1)
        assert float(gates.detach().std(dim=(0, 1)).min()) > 1e-3


# ------------------------------------------------------------------------------------------------
# Budget and rank allocation


@pytest.mark.parametrize("allocation", ["uniform", "spectrum"])
@pytest.mark.parametrize("heads", [1, 2])
def test_the_student_fits_the_budget_and_ranks_grow_with_it(teacher, allocation, heads):
    before = n_params(teacher)
    runs = [inhernet(teacher, InherNetConfig(target_fraction=f, allocation=allocation, heads=heads)) for f in FRACTIONS]
    for f, inh in zip(FRACTIONS, runs):
        assert inh.budget == math.floor(f * before) and inh.params_before == before
        assert n_params(inh.model) == inh.params_after <= inh.budget
        assert inh.params_after >= 0.93 * inh.budget  # the budget is used, not just respected
    for small, big in zip(runs, runs[1:]):
        assert all(big.ranks[k] >= small.ranks[k] for k in small.ranks), (small.budget, big.budget)
        assert sum(big.ranks.values()) > sum(small.ranks.values())
        assert sum(big.energy.values()) > sum(small.energy.values())


def test_spectrum_allocation_keeps_more_energy_than_uniform_at_the_same_budget(teacher):
    for f in (0.3, 0.5):
        uni = inhernet(teacher, InherNetConfig(target_fraction=f))
        spec = inhernet(teacher, InherNetConfig(target_fraction=f, allocation="spectrum"))
        assert spec.meta()["mean_energy"] > uni.meta()["mean_energy"]
        assert len(set(spec.ranks.values())) > 2  # it does differentiate between matrices


def test_an_absolute_budget_and_a_subset_of_modules(teacher):
    inh = inhernet(teacher, InherNetConfig(target_params=150_000, modules=("gate_proj", "up_proj", "down_proj")))
    assert n_params(inh.model) <= 150_000 and inh.budget == 150_000
    assert set(n.rsplit(".", 1)[-1] for n in inh.ranks) == {"gate_proj", "up_proj", "down_proj"}
    assert isinstance(inh.model.model.layers[0].self_attn.q_proj, torch.nn.Linear)
    assert isinstance(inh.model.model.layers[0].mlp.up_proj, InherLinear)


def test_a_budget_below_the_smallest_student_names_the_key(teacher):
    with pytest.raises(ValueError, match="^target_params: a budget of 1000 parameters is below the smallest student"):
        inhernet(teacher, InherNetConfig(target_params=1000))
    with pytest.raises(ValueError, match="^target_fraction: "):
        inhernet(teacher, InherNetConfig(target_fraction=0.05))  # 12.7k < the untouched 33k of embeddings and head


# ------------------------------------------------------------------------------------------------
# The inherited model in use


def test_the_teacher_is_left_unchanged_and_the_student_evaluates_and_recovers(teacher):
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    inh = inhernet(teacher, InherNetConfig(target_fraction=0.4, heads=2))
    assert all(torch.equal(before[k], v) for k, v in teacher.state_dict().items())
    tokens = torch.randint(0, VOCAB, (4096,), generator=torch.Generator().manual_seed(4)).numpy().astype(np.int64)
    loss = evaluate_loss(inh.model, tokens, seq_len=32, batch_size=8)
    assert math.isfinite(loss) and loss > evaluate_loss(teacher, tokens, seq_len=32, batch_size=8) - 0.5
    gate = inh.model.model.layers[1].mlp.down_proj.gate.weight.detach().clone()
    curve = recover(inh.model, teacher, tokens, DistillConfig(loss="kl", steps=6, lr=3e-3, batch_size=4, seq_len=32))
    assert curve.losses[-1] < curve.losses[0]
    assert not torch.equal(inh.model.model.layers[1].mlp.down_proj.gate.weight, gate)  # the gates train
    up = inh.model.model.layers[1].mlp.down_proj.up
    assert not torch.equal(up[0], up[1])  # and the heads, started equal, diverge


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_save_load_round_trip_and_to_dense(teacher, held_out, tmp_path, tied):
    from transformers import LlamaForCausalLM

    base = tied_llama() if tied else teacher
    inh = inhernet(base, InherNetConfig(target_fraction=0.6, allocation="spectrum"))
    want = logits(inh.model, held_out)
    save_inhernet(inh.model, tmp_path / "inh", inh.meta())
    loaded = load_inhernet(tmp_path / "inh")
    assert {n: m.rank for n, m in inher_linears(loaded).items()} == inh.ranks
    assert n_params(loaded) == inh.params_after
    torch.testing.assert_close(logits(loaded, held_out), want, rtol=0, atol=0)
    if tied:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight

    dense = to_dense(inh.model)
    assert type(dense) is type(base) and not inher_linears(dense) and n_params(dense) == n_params(base)
    torch.testing.assert_close(logits(dense, held_out), want, rtol=1e-4, atol=1e-4)
    dense.save_pretrained(tmp_path / "dense")
    torch.testing.assert_close(logits(LlamaForCausalLM.from_pretrained(tmp_path / "dense").eval(), held_out),
                               logits(dense, held_out), rtol=0, atol=0)


def test_multi_head_models_do_not_densify_and_other_folders_do_not_load(teacher, tmp_path):
    with pytest.raises(ValueError, match="^heads: a 2-head InherLinear"):
        to_dense(inhernet(teacher, InherNetConfig(rank=4, heads=2)).model)
    with pytest.raises(ValueError, match="inhernet.json: missing"):
        load_inhernet(tmp_path)
    with pytest.raises(ValueError, match="^model: LlamaForCausalLM has no InherLinear"):
        save_inhernet(teacher, tmp_path / "x")


# ------------------------------------------------------------------------------------------------
# Configuration errors


@pytest.mark.parametrize("kwargs,field", [
    ({"target_fraction": 0.0}, "target_fraction"),
    ({"target_fraction": 1.5}, "target_fraction"),
    ({"target_params": 0}, "target_params"),
    ({"rank": 0}, "rank"),
    ({"target_fraction": 0.5, "rank": 8}, "rank"),
    ({"target_fraction": 0.5, "target_params": 10}, "target_params"),
    ({"allocation": "greedy"}, "allocation"),
    ({"min_rank": 0}, "min_rank"),
    ({"heads": 0}, "heads"),
    ({"sigma": "down"}, "sigma"),
    ({"modules": ("",)}, "modules"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_config_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        InherNetConfig(**kwargs)


def test_unknown_module_names_name_modules(teacher):
    with pytest.raises(ValueError, match=r"^modules: no decoder-layer nn.Linear is named any of \['qproj'\]"):
        inhernet(teacher, InherNetConfig(modules=("qproj",)))


@pytest.mark.parametrize("shape", [(30, 70), (70, 30), (48, 48)], ids=["wide", "tall", "square"])
def test_thin_svd_is_the_svd(shape):
    """The Gram-matrix route gives the direct SVD's singular values, orthonormal factors and the
    matrix back; an ill-conditioned matrix falls back to the direct SVD, whose small directions stay exact."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(shape, generator=g, dtype=torch.float64) * torch.logspace(0, -2, shape[1], dtype=torch.float64)
    u, s, vh = thin_svd(w)
    ref = torch.linalg.svd(w, full_matrices=False)
    r = min(shape)
    assert u.shape == (shape[0], r) and s.shape == (r,) and vh.shape == (r, shape[1])
    torch.testing.assert_close(s, ref.S, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close((u * s) @ vh, w, rtol=0, atol=1e-10)
    torch.testing.assert_close(u.T @ u, torch.eye(r, dtype=torch.float64), rtol=0, atol=1e-9)
    torch.testing.assert_close(vh @ vh.T, torch.eye(r, dtype=torch.float64), rtol=0, atol=1e-8)
    k = r // 2  # the rank-k truncation (what inhernet keeps) agrees with the direct SVD's
    torch.testing.assert_close((u[:, :k] * s[:k]) @ vh[:k], (ref.U[:, :k] * ref.S[:k]) @ ref.Vh[:k], rtol=0, atol=1e-10)
    # condition 1e9: the squared Gram would lose the small directions; the direct SVD keeps them
    q1, _ = torch.linalg.qr(torch.randn(shape[0], r, generator=g, dtype=torch.float64))
    q2, _ = torch.linalg.qr(torch.randn(shape[1], r, generator=g, dtype=torch.float64))
    sig = torch.logspace(0, -9, r, dtype=torch.float64)
    u, s, vh = thin_svd((q1 * sig) @ q2.T)
    torch.testing.assert_close(s, sig, rtol=1e-5, atol=0)
