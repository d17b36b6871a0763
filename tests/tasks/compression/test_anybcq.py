"""tasks.compression.anybcq: nested planes, one artifact serving 2/3/4 bits with quality monotone in bits."""

from __future__ import annotations

import itertools

import pytest
import torch

from kernels.group_quant import reference as group_quant
from tasks.compression.anybcq import (
    AnyBCQConfig,
    _grouped,
    _uniform_planes,
    bcq_progressive,
    compress_anybcq,
    pack_planes,
)
from tasks.zoo.compressed import load_compressed_model, model_from_tensors, save_compressed
from tasks.zoo.decoders import bcq_dequantize, unpack_planes
from tasks.compression.rtn import RTNConfig, compress_rtn


@pytest.mark.parametrize(("rows", "cols", "group_size"), [(5, 63, 16), (33, 128, 128), (8, 500, 64)],
                         ids=["5x63-g16", "33x128-g128", "8x500-g64"])
def test_planes_are_nested_and_the_error_falls_with_every_plane(rows, cols, group_size):
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)) ** 3  # heavy tails
    planes, scales = bcq_progressive(w, min_bits=2, max_bits=4, group_size=group_size, iters=10)
    assert planes.shape == (4, rows, cols) and set(planes.unique().tolist()) == {-1.0, 1.0}
    errs = []
    for k, (alpha, z) in scales.items():
        assert alpha.shape == (rows, -(-cols // group_size), k)
        w_k = bcq_dequantize(planes[:k], alpha, z, group_size=group_size)
        errs.append(float(((w - w_k) ** 2).sum()))
    assert errs[0] > errs[1] > errs[2]
    # The third plane is the sign of the 2-bit residual: precision 3 only adds to precision 2.
    alpha2, z2 = scales[2]
    residual = w - bcq_dequantize(planes[:2], alpha2, z2, group_size=group_size)
    assert torch.equal(planes[2], torch.where(residual >= 0, 1.0, -1.0))


def test_alternating_fit_finds_the_best_two_plane_code_for_one_group():
    """At 2 bits the alternating minimisation should reach (near) the best of all 4**n sign assignments'
    least-squares fits on a group small enough to enumerate."""
    w = torch.tensor([[-1.3, -0.2, 0.1, 0.4, 0.45, 1.9]])
    planes, scales = bcq_progressive(w, min_bits=2, max_bits=2, group_size=6, iters=20, offset=False)
    alpha, z = scales[2]
    err = float(((w - bcq_dequantize(planes, alpha, z, group_size=6)) ** 2).sum())
    best = float("inf")
    for signs in itertools.product([-1.0, 1.0], repeat=12):
        b = torch.tensor(signs).reshape(2, 6)
        sol = torch.linalg.lstsq(b.T, w[0][:, None]).solution
        best = min(best, float(((w[0] - (b.T @ sol)[:, 0]) ** 2).sum()))
    assert err <= best * 1.05 + 1e-4


def test_plane_packing_round_trips_odd_widths():
    planes = torch.where(torch.rand(3, 7, 61, generator=torch.Generator().manual_seed(1)) > 0.5, 1.0, -1.0)
    packed = pack_planes(planes)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 7, 8)
    assert torch.equal(unpack_planes(packed, 61), planes)


def test_uniform_start_is_the_min_max_grid_written_as_planes():
    """Planes from the min–max grid with scales s/2, s, 2s, ... and offset lo + s (2^k - 1) / 2 give back
    round-to-nearest on that grid: uniform quantization is the special case of BCQ the fit starts from."""
    w = torch.randn(6, 40, generator=torch.Generator().manual_seed(3)) ** 3
    x, m = _grouped(w, 20)
    for bits in (2, 3, 4):
        planes = _uniform_planes(x, m, bits, offset=True)
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        s = (hi - lo) / (2**bits - 1)
        alpha = torch.stack([s[..., 0] * 2.0 ** (p - 1) for p in range(bits)], -1)
        z = lo[..., 0] + s[..., 0] * (2**bits - 1) / 2
        rebuilt = z[..., None] + torch.einsum("prgs,rgp->rgs", planes, alpha)
        assert torch.allclose(rebuilt, lo + s * ((x - lo) / s).round(), atol=1e-5)


@pytest.mark.parametrize("group_size", [32, 128])
def test_uniform_start_fits_no_worse_than_rtn_at_two_bits(group_size):
    """From the min–max grid the least-squares scales and sign rounds can only lower the error, so
    2-bit AnyBCQ is at least as close to the weights as 2-bit RTN's grid on the same groups."""
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(4)) ** 3
    q, scale, zero = group_quant.quantize(w, bits=2, group_size=group_size)
    rtn = float(((w - group_quant.dequantize(q, scale, zero, group_size=group_size)) ** 2).sum())
    planes, scales = bcq_progressive(w, min_bits=2, max_bits=2, group_size=group_size, iters=6, init="uniform")
    bcq = float(((w - bcq_dequantize(planes, *scales[2], group_size=group_size)) ** 2).sum())
    assert bcq < rtn


def test_activation_weighting_protects_the_channels_that_carry_large_inputs():
    """A layer whose channel 5 carries inputs 30x the others: weighing the least squares by E[x^2]
    lowers the error of the layer's output, which the plain Frobenius fit does not look at."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(48, 64, generator=gen)
    x = torch.randn(512, 64, generator=gen)
    x[:, 5] *= 30
    h = (x**2).mean(0)
    out_err = {}
    for name, cw in (("none", None), ("activation", h / h.mean() + 1e-3)):
        planes, scales = bcq_progressive(w, min_bits=2, max_bits=3, group_size=32, iters=6, channel_weight=cw)
        out_err[name] = [float(((x @ (w - bcq_dequantize(planes[:k], *scales[k], group_size=32)).T) ** 2).mean())
                         for k in (2, 3)]
    assert all(a < 0.8 * n for a, n in zip(out_err["activation"], out_err["none"]))


def test_activation_weighting_needs_calibration_tokens(model_and_text):
    with pytest.raises(ValueError, match=r"anybcq \(weighting: activation\) needs calibration tokens"):
        compress_anybcq(model_and_text[0], AnyBCQConfig(bits=2, group_size=32))
    data_free = compress_anybcq(model_and_text[0], AnyBCQConfig(bits=2, group_size=32, weighting="none", iters=1))
    assert data_free.meta["calib_windows"] == 0


@pytest.fixture(scope="module")
def artifact(model_and_text):
    return compress_anybcq(model_and_text[0], AnyBCQConfig(bits=2, group_size=32), calib_tokens=model_and_text[1])


def _loss(model, tokens):
    with torch.no_grad():
        return model(input_ids=tokens, labels=tokens).loss.item()


def test_one_artifact_serves_2_3_4_bits_monotonically(model_and_text, artifact, tmp_path):
    model, _, held_out = model_and_text
    path = tmp_path / "bcq.safetensors"
    save_compressed(artifact, path)
    loss = {b: _loss(load_compressed_model(path, model, bits=b), held_out) for b in (2, 3, 4)}
    fp = _loss(model, held_out)
    assert loss[2] > loss[3] > loss[4] > fp  # measured 5.44 > 5.28 > 5.25 > 5.22
    errors = artifact.meta["weight_error"]
    assert errors["2"] > errors["3"] > errors["4"]
    assert artifact.meta["precisions"] == {"2": 2 + 16 * 3 / 32, "3": 3 + 16 * 4 / 32, "4": 4 + 16 * 5 / 32}
    # The default precision is the config's, and equals the in-memory model.
    with torch.no_grad():
        assert torch.equal(load_compressed_model(path, model)(input_ids=held_out).logits,
                           artifact.model(input_ids=held_out).logits)
    with pytest.raises(ValueError, match=r"serves bits \[2, 3, 4\], not 5"):
        load_compressed_model(path, model, bits=5)


def test_two_bit_bcq_beats_rtn_at_no_more_bits_per_weight(model_and_text):
    model, _, held_out = model_and_text
    bcq = compress_anybcq(model, AnyBCQConfig(bits=2, group_size=64), calib_tokens=model_and_text[1])  # 2.75 bpw
    rtn = compress_rtn(model, RTNConfig(bits=2, group_size=32))  # 3.0 bpw
    assert bcq.meta["bits_per_weight"] <= rtn.meta["bits_per_weight"]
    assert _loss(bcq.model, held_out) < _loss(rtn.model, held_out)  # measured 5.46 vs 5.58


def test_precision_is_read_from_the_first_planes_only(model_and_text, artifact):
    """Serving 2 bits must not depend on planes 3 and 4: corrupting them leaves the 2-bit model unchanged."""
    model = model_and_text[0]
    key = next(k for k in artifact.tensors if k.endswith(".planes"))
    tampered = dict(artifact.tensors)
    tampered[key] = artifact.tensors[key].clone()
    tampered[key][2:] ^= 0xFF
    a = model_from_tensors(artifact.tensors, artifact.meta, model, bits=2).state_dict()
    b = model_from_tensors(tampered, artifact.meta, model, bits=2).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = model_from_tensors(tampered, artifact.meta, model, bits=4).state_dict()
    assert not all(torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("bad", [{"bits": 5}, {"min_bits": 3, "max_bits": 2, "bits": 3}, {"group_size": 1},
                                 {"init": "kmeans"}, {"weighting": "hessian"}, {"seq_len": 1}],
                         ids=["bits_outside", "min_gt_max", "group1", "init", "weighting", "seq_len"])
def test_config_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        AnyBCQConfig(**bad)
