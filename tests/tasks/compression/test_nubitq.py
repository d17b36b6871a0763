"""tasks.compression.nubitq: weighted Lloyd codebooks, bit allocation to a budget, and the OCP parts."""

from __future__ import annotations

import pytest
import torch

from tasks.compression.gptq import GPTQConfig, compress_gptq
from tasks.compression.nubitq import (
    NuBitQConfig,
    allocate_bits,
    compress_nubitq,
    lsq_codebook,
    to_csr,
    weighted_lloyd,
)
from tasks.zoo.compressed import load_compressed_model, save_compressed
from tasks.zoo.decoders import from_csr
from tasks.compression.rtn import RTNConfig, compress_rtn


def _weighted_error(x, w, book, codes):
    return float((w * (x - torch.gather(book, 1, codes)) ** 2).sum())


def test_weighted_lloyd_beats_plain_kmeans_on_the_weighted_objective():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 301, generator=g) ** 3
    w = torch.exp(2 * torch.randn(1, 301, generator=g)).expand(6, -1)  # a few channels dominate, as in LLMs
    book, codes = weighted_lloyd(x, w, 8, iters=25)
    plain_book, plain_codes = weighted_lloyd(x, torch.ones_like(x), 8, iters=25)
    assert book.shape == (6, 8) and codes.shape == (6, 301) and int(codes.max()) <= 7
    assert (book[:, 1:] >= book[:, :-1]).all()
    assert torch.equal(book, book.half().float())  # on the fp16 grid, as stored
    assert _weighted_error(x, w, book, codes) < 0.9 * _weighted_error(x, w, plain_book, plain_codes)
    # Codes are the nearest level of each row's codebook.
    dist = (x[..., None] - book[:, None, :]).abs()
    assert torch.equal(torch.gather(dist, 2, codes[..., None])[..., 0], dist.min(-1).values)


def test_allocate_bits_spends_the_budget_where_error_falls_most():
    errors = {"a": {2: 10.0, 3: 9.0, 4: 8.5}, "b": {2: 50.0, 3: 10.0, 4: 4.0}}
    costs = {"a": {2: 200, 3: 300, 4: 400}, "b": {2: 200, 3: 300, 4: 400}}
    assert allocate_bits(errors, costs, 500) == {"a": 2, "b": 3}
    assert allocate_bits(errors, costs, 600) == {"a": 2, "b": 4}
    assert allocate_bits(errors, costs, 10_000) == {"a": 4, "b": 4}
    with pytest.raises(ValueError, match="budget_bits too small"):
        allocate_bits(errors, costs, 399)


def test_outlier_csr_round_trips_and_refuses_bad_indices():
    mask = torch.rand(9, 70, generator=torch.Generator().manual_seed(1)) > 0.93
    w = torch.randn(9, 70)
    vals, cols, rowptr = to_csr(mask, w)
    assert cols.dtype == torch.int16 and rowptr.shape == (10,) and vals.numel() == int(mask.sum())
    r, c = from_csr(vals, cols, rowptr, (9, 70))
    back = torch.zeros(9, 70, dtype=torch.bool)
    back[r, c] = True
    assert torch.equal(back, mask)
    with pytest.raises(ValueError, match="outside"):
        from_csr(vals, cols.clone().fill_(70), rowptr, (9, 70))
    with pytest.raises(ValueError, match="do not describe"):
        from_csr(vals, cols, rowptr[:-1], (9, 70))


def test_lsq_codebook_lowers_the_layer_output_error():
    g = torch.Generator().manual_seed(2)
    cols = 48
    mix = torch.randn(cols, cols, generator=g) / cols**0.5 + torch.eye(cols)
    x = torch.randn(400, cols, generator=g) @ mix
    w = torch.randn(12, cols, generator=g)
    h = x.T @ x / len(x)
    book, codes = weighted_lloyd(w, h.diagonal().expand(12, -1), 4, iters=20)
    keep = torch.rand(12, cols, generator=g) > 0.05
    new = lsq_codebook(w, codes, book, h, keep=keep)

    def out_err(b):
        w_hat = torch.where(keep, torch.gather(b, 1, codes.long()), w)
        return float(((x @ (w - w_hat).T) ** 2).mean())

    # The exact optimum over each row's codebook, by least squares on X itself.
    exact = book.clone()
    for r in range(12):
        a = torch.nn.functional.one_hot(codes[r].long(), 4).float() * keep[r][:, None]
        sol = torch.linalg.lstsq(x @ a, (x @ (w[r] * keep[r]))[:, None]).solution[:, 0]
        exact[r] = torch.where(a.sum(0) > 0, sol, book[r])
    assert out_err(new) < 0.95 * out_err(book)  # measured 7.10 vs 7.66
    assert out_err(new) == pytest.approx(out_err(exact), rel=1e-3)  # damping and fp16 cost ~nothing


@pytest.fixture(scope="module")
def setup(model_and_text):
    model, calib, held_out = model_and_text

    def loss(m):
        with torch.no_grad():
            return m(input_ids=held_out, labels=held_out).loss.item()

    return model, calib.flatten().numpy(), held_out, loss


def test_two_bit_tensor_codebooks_beat_rtn_and_gptq_at_fewer_bits(setup):
    model, calib, _, loss = setup
    nu = compress_nubitq(model, NuBitQConfig(bits=2, codebook="tensor", seq_len=64), calib_tokens=calib)
    rtn = compress_rtn(model, RTNConfig(bits=2, group_size=32))
    gptq = compress_gptq(model, GPTQConfig(bits=2, group_size=32, seq_len=64), calib_tokens=calib)
    assert nu.meta["bits_per_weight"] < rtn.meta["bits_per_weight"] == gptq.meta["bits_per_weight"] == 3.0
    assert loss(nu.model) < min(loss(rtn.model), loss(gptq.model))  # measured 5.42 vs 5.50 / 5.49


def test_budget_is_met_and_propagation_helps_the_allocation(setup):
    model, calib, _, loss = setup
    cfg = NuBitQConfig(budget_bits=3.0, codebook="tensor", seq_len=64)
    with_f = compress_nubitq(model, cfg, calib_tokens=calib)
    without = compress_nubitq(model, NuBitQConfig(budget_bits=3.0, codebook="tensor", seq_len=64, propagation=False),
                              calib_tokens=calib)
    for cm in (with_f, without):
        assert cm.meta["bits_per_weight"] <= 3.0
        assert set(cm.meta["layer_bits"].values()) > {3} or len(set(cm.meta["layer_bits"].values())) > 1
    assert loss(with_f.model) < loss(without.model)  # measured 5.263 vs 5.368


def test_a_budget_below_the_narrowest_widths_stores_them_and_says_so(setup):
    """Row codebooks on 64-wide rows cost 1 bit per weight on top of the codes: 2.1 bpw cannot be met."""
    model, calib, _, _ = setup
    cfg = NuBitQConfig(budget_bits=2.1, codebook="row", seq_len=64)
    with pytest.warns(UserWarning, match="budget_met: false"):
        cm = compress_nubitq(model, cfg, calib_tokens=calib)
    assert cm.meta["budget_met"] is False and cm.meta["bits_per_weight"] > 2.1
    assert set(cm.meta["layer_bits"].values()) == {2}
    with pytest.raises(ValueError, match="budget_bits too small"):
        compress_nubitq(model, NuBitQConfig(budget_bits=2.1, codebook="row", seq_len=64, infeasible_budget="error"),
                        calib_tokens=calib)
    assert compress_nubitq(model, NuBitQConfig(budget_bits=3.0, codebook="tensor", seq_len=64),
                           calib_tokens=calib).meta["budget_met"] is True


def test_outliers_stay_exact_help_and_round_trip(setup, tmp_path):
    model, calib, held_out, loss = setup
    base = compress_nubitq(model, NuBitQConfig(bits=2, codebook="tensor", seq_len=64), calib_tokens=calib)
    cm = compress_nubitq(model, NuBitQConfig(bits=2, codebook="tensor", seq_len=64, outlier_frac=0.01,
                                             block_correction=False), calib_tokens=calib)
    n_q = cm.meta["n_quantized_params"]
    assert cm.meta["outliers"] == pytest.approx(0.01 * n_q, abs=20)
    assert cm.meta["bits_per_weight"] > base.meta["bits_per_weight"]  # outliers are paid for
    assert loss(cm.model) < loss(base.model)  # measured 5.37 vs 5.42
    key = "model.layers.0.mlp.down_proj.weight"
    r, c = from_csr(cm.tensors[f"{key}.outlier_values"], cm.tensors[f"{key}.outlier_cols"],
                    cm.tensors[f"{key}.outlier_rowptr"], tuple(cm.meta["quantized"][key]["shape"]))
    w = dict(model.named_parameters())[key].detach()
    assert torch.equal(dict(cm.model.named_parameters())[key][r, c], w[r, c].half().float())
    save_compressed(cm, tmp_path / "nu.safetensors")
    loaded = load_compressed_model(tmp_path / "nu.safetensors", model)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=held_out).logits, cm.model(input_ids=held_out).logits)


def test_row_codebooks_with_block_correction_round_trip(setup, tmp_path):
    model, calib, held_out, loss = setup
    cm = compress_nubitq(model, NuBitQConfig(bits=3, codebook="row", seq_len=64, block_correction=True),
                         calib_tokens=calib)
    assert len(cm.meta["block_correction_mean_abs_change"]) == 4  # o_proj and down_proj of 2 blocks
    assert cm.meta["bits_per_weight"] == pytest.approx(
        sum(s["shape"][0] * (s["shape"][1] * 3 + 16 * 8) for s in cm.meta["quantized"].values()) / cm.meta["n_quantized_params"])
    save_compressed(cm, tmp_path / "row.safetensors")
    loaded = load_compressed_model(tmp_path / "row.safetensors", model)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=held_out).logits, cm.model(input_ids=held_out).logits)


@pytest.mark.parametrize("bad", [{"bits": 0}, {"bit_choices": (3, 2)}, {"outlier_frac": 0.6}, {"budget_bits": 0.0}],
                         ids=["bits0", "choices_unsorted", "outliers_too_many", "budget0"])
def test_config_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        NuBitQConfig(**bad)


@pytest.mark.parametrize("scope", ["row", "group", "tensor"])
def test_fitting_several_widths_from_one_sort_equals_fitting_each(scope):
    from tasks.compression.nubitq import fit_layer, fit_layer_widths

    g = torch.Generator().manual_seed(5)
    w = torch.randn(37, 130, generator=g) ** 3
    imp = torch.exp(torch.randn(37, 1, generator=g) + torch.randn(1, 130, generator=g))
    shared = fit_layer_widths(w, imp, (2, 3, 4), scope, 64, iters=7)
    assert list(shared) == [2, 3, 4]
    for bits, code in shared.items():
        alone = fit_layer(w, imp, bits, scope, 64, iters=7)
        assert code.bits == bits and code.codebook.shape[1] == 2**bits
        assert torch.equal(code.codes, alone.codes) and torch.equal(code.codebook, alone.codebook)
        assert (code.row_scale is None) == (scope != "tensor")
        if scope == "tensor":
            assert torch.equal(code.row_scale, alone.row_scale)
