"""kernels.sparse_gemv: TEAL's sparse GEMV, Triton (interpreted / CUDA) vs the gathering torch reference."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import sparse_gemv as public
from kernels.sparse_gemv import reference
from kernel_support import CUDA, DEVICE, needs_cuda, rel_err, triton_module

triton_impl, needs_triton = triton_module("sparse_gemv")


def _masked_dense(x, w, threshold):
    """The op's definition, independently of both implementations."""
    xf = x.float()
    return torch.where(xf.abs() >= threshold, xf, 0.0) @ w.float().t()


def _problem(tokens, out_f, in_f, dtype, seed=0, layout="row", device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, in_f, generator=g).to(dtype).to(device)
    w = (torch.randn(out_f, in_f, generator=g) / math.sqrt(in_f)).to(dtype).to(device)
    if layout == "channel_major":  # TEAL's layout: channel i's column is a contiguous row of w_t
        w = w.t().contiguous().t()
    return x, w


_rel_err = rel_err


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# (tokens, out, in): odd sizes, one token (decoding) and a few, and a 1x1.
SHAPES = [(1, 63, 500), (3, 500, 63), (1, 1, 1), (2, 128, 256), (1, 257, 129)]
# Thresholds on N(0, 1) inputs: 0 = dense; 0.67 ~ 50% sparse; 1.5 ~ 87% sparse; 10 = nothing active.
THRESHOLDS = [0.0, 0.67, 1.5, 10.0]


def _shape_id(s):
    return "t{}_{}x{}".format(*s)


@needs_triton
@pytest.mark.parametrize("threshold", THRESHOLDS, ids=lambda t: f"thr{t}")
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_triton_matches_reference_fp32(shape, threshold, poison_empty):
    x, w = _problem(*shape, torch.float32, device=DEVICE)
    y = triton_impl.sparse_gemv(x, w, threshold=threshold)
    y_ref = reference.sparse_gemv(x, w, threshold=threshold)
    assert y.shape == (shape[0], shape[1]) and not torch.isnan(y).any()
    if threshold >= 10.0:
        assert torch.equal(y, torch.zeros_like(y))
    else:
        assert _rel_err(y, y_ref) <= TOL[torch.float32]


@needs_triton
@pytest.mark.parametrize("layout", ["row", "channel_major"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape", [(1, 63, 500), (3, 500, 63)], ids=_shape_id)
def test_triton_matches_reference_dtypes_and_layouts(shape, dtype, layout, poison_empty):
    x, w = _problem(*shape, dtype, seed=1, layout=layout, device=DEVICE)
    y = triton_impl.sparse_gemv(x, w, threshold=0.67)
    assert y.dtype == dtype
    assert _rel_err(y, reference.sparse_gemv(x, w, threshold=0.67)) <= TOL[dtype]


@needs_triton
@pytest.mark.parametrize("blocks", [(64, 16), (32, 64), (128, 32)], ids=lambda b: f"bn{b[0]}_bk{b[1]}")
def test_triton_tile_sizes_agree(blocks, poison_empty):
    x, w = _problem(2, 100, 300, torch.float32, seed=2, device=DEVICE)
    y = triton_impl.sparse_gemv(x, w, threshold=0.67, block_n=blocks[0], block_k=blocks[1])
    assert _rel_err(y, reference.sparse_gemv(x, w, threshold=0.67)) <= 1e-5


@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("shape", [(1, 63, 500), (3, 500, 63)], ids=_shape_id)
def test_inactive_columns_are_never_read(shape, impl):
    """NaN in every inactive channel's weight column: any read of one would poison the output."""
    x, w = _problem(*shape, torch.float32, seed=3)
    active = x.abs() >= 0.67
    idle = ~active.any(dim=0)  # channels inactive for every token
    assert idle.sum() > 0
    w_poisoned = w.clone()
    w_poisoned[:, idle] = math.nan
    fn = reference.sparse_gemv if impl == "reference" else triton_impl.sparse_gemv
    device = "cpu" if impl == "reference" else DEVICE
    y = fn(x.to(device), w_poisoned.to(device), threshold=0.67)
    assert not torch.isnan(y).any()
    assert _rel_err(y.cpu(), _masked_dense(x, w, 0.67)) <= 1e-5


@pytest.mark.parametrize("threshold", THRESHOLDS, ids=lambda t: f"thr{t}")
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_reference_matches_masked_dense_definition(shape, threshold):
    x, w = _problem(*shape, torch.float32, seed=4)
    y = reference.sparse_gemv(x, w, threshold=threshold)
    assert _rel_err(y, _masked_dense(x, w, threshold)) <= 1e-5 or threshold >= 10.0
    if threshold == 0.0:
        assert _rel_err(y, x @ w.t()) <= 1e-5


def test_leading_dims_and_vector_input():
    x, w = _problem(6, 40, 24, torch.float32, seed=5)
    y = public.sparse_gemv(x.view(2, 3, 24), w, threshold=0.5)
    assert y.shape == (2, 3, 40)
    torch.testing.assert_close(y.view(6, 40), _masked_dense(x, w, 0.5), rtol=1e-5, atol=1e-6)
    y1 = public.sparse_gemv(x[0], w, threshold=0.5)
    assert y1.shape == (40,)
    torch.testing.assert_close(y1, _masked_dense(x[:1], w, 0.5)[0], rtol=1e-5, atol=1e-6)


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="x: expected"):
        public.sparse_gemv(torch.zeros(3, 5), torch.zeros(4, 6), threshold=0.1)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("sparsity_threshold", [0.32, 0.67, 1.04], ids=["25pct", "50pct", "70pct"])
def test_cuda_decoding_size(sparsity_threshold):
    x, w = _problem(1, 4096, 11008, torch.float16, seed=6, layout="channel_major", device="cuda")
    y = triton_impl.sparse_gemv(x, w, threshold=sparsity_threshold)
    assert _rel_err(y, reference.sparse_gemv(x, w, threshold=sparsity_threshold)) <= TOL[torch.float16]
