"""kernels.group_quant: Triton (interpreted on CPU, compiled on CUDA) against the fp32 torch reference."""

from __future__ import annotations

import math

import pytest
import torch

import kernels._dispatch as dispatch
from kernels import group_quant
from kernels.group_quant import reference
from kernel_support import CUDA, DEVICE, needs_cuda, triton_module

triton_impl, needs_triton = triton_module("group_quant")


SHAPES = [(1, 1), (63, 500), (7, 33), (128, 64), (500, 63)]
SETTINGS = [(4, 32), (8, 32), (3, 7), (2, 128), (4, 500)]


def _ids(v):
    return str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else "x".join(map(str, v))


def _setting_id(v):
    return f"w{v[0]}g{v[1]}"


def _weights(shape, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    # Heavy-ish tails and an offset, so groups are not symmetric around zero.
    w = torch.randn(shape, generator=g) * 0.05 + 0.01 * torch.randn(shape[0], 1, generator=g)
    return w.to(dtype).to(device)


def _expand(per_group: torch.Tensor, cols: int, group_size: int) -> torch.Tensor:
    return per_group.float().repeat_interleave(group_size, dim=1)[:, :cols]


# Every shape x setting in fp32, and every dtype on the two odd shapes (the interpreter is slow).
CASES = [(shape, setting, torch.float32) for shape in SHAPES for setting in SETTINGS] + [
    (shape, setting, dtype)
    for shape in [(63, 500), (500, 63)]
    for setting in [(4, 32), (8, 128)]
    for dtype in [torch.float16, torch.bfloat16]
]


@needs_triton
@pytest.mark.parametrize(
    ("shape", "setting", "dtype"), CASES, ids=[f"{_ids(a)}-{_setting_id(b)}-{_ids(c)}" for a, b, c in CASES]
)
def test_triton_matches_reference(shape, setting, dtype, poison_empty):
    bits, group_size = setting
    w = _weights(shape, dtype, device=DEVICE)
    q, scale, zero = triton_impl.quantize(w, bits=bits, group_size=group_size)
    q_ref, scale_ref, zero_ref = reference.quantize(w, bits=bits, group_size=group_size)
    groups = math.ceil(shape[1] / group_size)
    assert q.shape == shape and q.dtype == torch.uint8
    assert scale.shape == zero.shape == (shape[0], groups)
    assert scale.dtype == zero.dtype == torch.float16
    torch.testing.assert_close(scale, scale_ref, rtol=1e-3, atol=0)
    torch.testing.assert_close(zero, zero_ref, rtol=0, atol=1)
    # Codes may differ by one where w / scale sits on a rounding boundary (CUDA's fp32 division).
    diff = (q.int() - q_ref.int()).abs()
    assert diff.max() <= 1 and diff.float().mean() <= 1e-3

    w_hat = triton_impl.dequantize(q, scale, zero, group_size=group_size, dtype=dtype)
    w_hat_ref = reference.dequantize(q, scale, zero, group_size=group_size, dtype=dtype)
    assert w_hat.dtype == dtype and not torch.isnan(w_hat).any()
    rel = (w_hat.float() - w_hat_ref.float()).norm() / w_hat_ref.float().norm().clamp_min(1e-12)
    assert rel <= {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]


@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("setting", SETTINGS, ids=_setting_id)
@pytest.mark.parametrize("shape", [(63, 500), (500, 63)], ids=_ids)
def test_rounding_error_within_half_a_step(shape, setting, impl):
    bits, group_size = setting
    mod = reference if impl == "reference" else triton_impl
    device = "cpu" if impl == "reference" else DEVICE
    w = _weights(shape, torch.float32, seed=1, device=device)
    q, scale, zero = mod.quantize(w, bits=bits, group_size=group_size)
    w_hat = mod.dequantize(q, scale, zero, group_size=group_size)
    step = _expand(scale, shape[1], group_size)
    assert ((w - w_hat).abs() <= step / 2 * (1 + 1e-5)).all()
    assert q.max() <= 2**bits - 1
    assert ((zero >= 0) & (zero <= 2**bits - 1) & (zero == zero.round())).all()
    # The scale is the smallest fp16 at or above the group's range / qmax (what keeps the bound).
    lo = torch.clamp(reference._grouped(w, group_size, math.inf).amin(-1), max=0)
    hi = torch.clamp(reference._grouped(w, group_size, -math.inf).amax(-1), min=0)
    exact = (hi - lo) / (2**bits - 1)
    assert (scale.float() >= exact).all() and (scale.float() <= exact * (1 + 2**-9) + 2**-14).all()


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_zero_and_constant_groups(bits):
    w = torch.zeros(3, 40)
    w[1, :20] = 0.25  # one constant positive group
    w[2, 20:] = -3.0  # one constant negative group
    q, scale, zero = group_quant.quantize(w, bits=bits, group_size=20)
    w_hat = group_quant.dequantize(q, scale, zero, group_size=20)
    assert torch.equal(w_hat[0], w[0])  # an all-zero group comes back exactly (0 is on the grid)
    assert torch.isfinite(scale.float()).all() and (scale.float() > 0).all()
    assert ((w - w_hat).abs() <= _expand(scale, 40, 20) / 2 * (1 + 1e-5)).all()


def test_more_bits_smaller_error():
    w = _weights((64, 256), torch.float32, seed=2)
    errors = []
    for bits in (2, 3, 4, 8):
        q, s, z = group_quant.quantize(w, bits=bits, group_size=64)
        errors.append((w - group_quant.dequantize(q, s, z, group_size=64)).pow(2).mean().item())
    assert errors == sorted(errors, reverse=True)
    assert errors[-1] < errors[2] / 100  # 8 bits: steps 17x finer than 4 bits


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("cols", [1, 7, 63, 64, 500])
def test_pack_unpack_round_trip(bits, cols):
    g = torch.Generator().manual_seed(bits * 1000 + cols)
    q = torch.randint(0, 2**bits, (5, cols), generator=g, dtype=torch.uint8)
    packed = reference.pack_codes(q, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (5, math.ceil(cols * bits / 8))
    assert torch.equal(reference.unpack_codes(packed, bits, cols), q)


def test_pack_4bit_is_two_per_byte_low_nibble_first():
    q = torch.tensor([[1, 2, 3], [15, 0, 9]], dtype=torch.uint8)
    packed = reference.pack_codes(q, 4)
    assert packed.tolist() == [[0x21, 0x03], [0x0F, 0x09]]
    # 2 bits: four per byte, first column in the lowest bits.
    q2 = torch.tensor([[1, 2, 3, 0, 1]], dtype=torch.uint8)
    assert reference.pack_codes(q2, 2).tolist() == [[1 | (2 << 2) | (3 << 4) | (0 << 6), 1]]


def test_inputs_are_checked():
    with pytest.raises(ValueError, match="bits"):
        group_quant.quantize(torch.zeros(2, 4), bits=9, group_size=2)
    with pytest.raises(ValueError, match="2-D"):
        group_quant.quantize(torch.zeros(8), bits=4, group_size=2)
    q, s, z = group_quant.quantize(torch.zeros(2, 4), bits=4, group_size=2)
    with pytest.raises(ValueError, match="scale/zero"):
        group_quant.dequantize(q, s, z, group_size=4)


# --- dispatch -------------------------------------------------------------------------------


def test_dispatch_cpu_defaults_to_reference(monkeypatch):
    monkeypatch.delenv("SCALELAB_TRITON", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    name, reason = dispatch.backend("cpu")
    assert name == "reference" and "CUDA" in reason


def test_dispatch_honours_requests(monkeypatch):
    monkeypatch.setenv("SCALELAB_TRITON", "reference")
    assert dispatch.backend("cpu").name == "reference"
    monkeypatch.setenv("SCALELAB_TRITON", "interpret")
    expected = "interpret" if dispatch.triton_available() else "reference"
    assert dispatch.backend("cpu").name == expected
    monkeypatch.setenv("SCALELAB_TRITON", "fast")
    with pytest.raises(ValueError, match="SCALELAB_TRITON"):
        dispatch.backend("cpu")


def test_missing_triton_warns_once_and_falls_back(monkeypatch):
    monkeypatch.delenv("SCALELAB_TRITON", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    dispatch._warn_missing_triton.cache_clear()
    with pytest.warns(RuntimeWarning, match="pip install triton"):
        first = dispatch.backend("cuda")
    assert first.name == "reference"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.backend("cuda").name == "reference"  # no second warning
    dispatch._warn_missing_triton.cache_clear()


@needs_triton
def test_public_entry_point_uses_the_interpreter_or_cuda_and_matches():
    w = _weights((33, 96), torch.float32, seed=3, device=DEVICE)
    assert dispatch.backend(w.device).name in ("interpret", "triton")
    q, s, z = group_quant.quantize(w, bits=4, group_size=32)
    q_ref, s_ref, z_ref = reference.quantize(w, bits=4, group_size=32)
    assert (q.int() - q_ref.int()).abs().max() <= 1
    torch.testing.assert_close(s, s_ref, rtol=1e-3, atol=0)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=_ids)
def test_cuda_large_matrix(dtype):
    w = _weights((4096, 4096), dtype, seed=4, device="cuda")
    q, s, z = triton_impl.quantize(w, bits=4, group_size=128)
    q_ref, s_ref, z_ref = reference.quantize(w, bits=4, group_size=128)
    diff = (q.int() - q_ref.int()).abs()
    assert diff.max() <= 1 and diff.float().mean() <= 1e-4
    w_hat = triton_impl.dequantize(q, s, z, group_size=128, dtype=dtype)
    torch.testing.assert_close(w_hat, reference.dequantize(q, s, z, group_size=128, dtype=dtype))
