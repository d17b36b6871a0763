"""kernels.sparse_gemv.cpu: the C++ CPU sparse GEMV against the torch reference, and the CPU dispatch."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import sparse_gemv as public
from kernels.sparse_gemv import cpu, reference
from kernel_support import rel_err

needs_extension = pytest.mark.skipif(not cpu.available(), reason="the C++ kernel did not build here (no g++ with "
                                     "OpenMP?): kernels.sparse_gemv.cpu falls back to the reference")


def _problem(tokens, out_f, in_f, dtype=torch.float32, seed=0, layout="row"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, in_f, generator=g).to(dtype)
    w = (torch.randn(out_f, in_f, generator=g) / math.sqrt(in_f)).to(dtype)
    if layout == "channel_major":
        w = w.t().contiguous().t()
    return x, w


# (tokens, out, in): odd sizes, one token and a few, 1x1, one output, one input, and sizes large
# enough that the active rows are split across threads (rows >= 32768 / out per thread).
SHAPES = [(1, 63, 500), (3, 500, 63), (1, 1, 1), (1, 1, 77), (2, 77, 1), (2, 128, 256), (1, 257, 129),
          (1, 3001, 2000), (2, 500, 4099)]
THRESHOLDS = [0.0, 0.67, 1.5, 10.0]  # dense, ~50%, ~87% sparse, nothing active
LAYOUTS = ["row", "channel_major"]


def _shape_id(s):
    return "t{}_{}x{}".format(*s)


@needs_extension
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("threshold", THRESHOLDS, ids=lambda t: f"thr{t}")
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_matches_reference(shape, threshold, layout, poison_empty):
    x, w = _problem(*shape, layout=layout)
    y = cpu.sparse_gemv(x, w, threshold=threshold)
    y_ref = reference.sparse_gemv(x, w, threshold=threshold)
    assert y.shape == (shape[0], shape[1]) and y.dtype == torch.float32 and not torch.isnan(y).any()
    if threshold >= 10.0:
        assert torch.equal(y, torch.zeros_like(y))
    else:
        assert rel_err(y, y_ref, floor_per_elem=1e-3) <= 1e-5


@needs_extension
@pytest.mark.parametrize("threads", [1, 2, 3], ids=lambda n: f"threads{n}")
def test_thread_counts_agree(threads):
    """The per-thread accumulators are summed whatever the thread count (3 > this machine's cores)."""
    x, w = _problem(1, 4099, 3001, seed=7, layout="channel_major")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        y = cpu.sparse_gemv(x, w, threshold=0.67)
    finally:
        torch.set_num_threads(before)
    assert rel_err(y, reference.sparse_gemv(x, w, threshold=0.67)) <= 1e-5


@needs_extension
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", [(1, 63, 500), (3, 500, 63), (1, 2049, 3000)], ids=_shape_id)
def test_inactive_columns_are_never_read(shape, layout):
    """NaN in every inactive channel's weight column: any read of one would poison the output."""
    x, w = _problem(*shape, seed=3)
    idle = ~(x.abs() >= 0.67).any(dim=0)
    assert idle.sum() > 0
    poisoned = w.clone()
    poisoned[:, idle] = math.nan
    if layout == "channel_major":
        poisoned = poisoned.t().contiguous().t()
    y = cpu.sparse_gemv(x, poisoned, threshold=0.67)
    assert not torch.isnan(y).any()
    assert rel_err(y, reference.sparse_gemv(x, w, threshold=0.67)) <= 1e-5


@pytest.mark.parametrize("case", ["bfloat16", "strided"])
def test_what_the_kernel_does_not_cover_runs_the_reference(case):
    if case == "bfloat16":
        x, w = _problem(2, 63, 500, torch.bfloat16, seed=4)
    else:  # neither rows nor columns contiguous
        x, w = _problem(2, 126, 1000, seed=4)
        x, w = x[:, ::2], w[::2, ::2]
    y = cpu.sparse_gemv(x, w, threshold=0.67)
    assert y.dtype == x.dtype
    assert torch.equal(y, reference.sparse_gemv(x, w, threshold=0.67))


@needs_extension
def test_leading_dims_vector_input_and_noncontiguous_x():
    x, w = _problem(6, 40, 24, seed=5, layout="channel_major")
    y = cpu.sparse_gemv(x.view(2, 3, 24), w, threshold=0.5)
    assert y.shape == (2, 3, 40)
    torch.testing.assert_close(y.view(6, 40), reference.sparse_gemv(x, w, threshold=0.5), rtol=1e-5, atol=1e-6)
    assert cpu.sparse_gemv(x[0], w, threshold=0.5).shape == (40,)
    xt = x.t().contiguous().t()  # same values, column-major storage
    torch.testing.assert_close(cpu.sparse_gemv(xt, w, threshold=0.5), y.view(6, 40))
    with pytest.raises(ValueError, match="x: expected"):
        cpu.sparse_gemv(torch.zeros(3, 5), torch.zeros(4, 6), threshold=0.1)


@pytest.mark.parametrize("env,expected", [({"SCALELAB_TRITON": "auto"}, "cpu"),
                                          ({"SCALELAB_TRITON": "reference"}, "reference")],
                         ids=["auto", "forced_reference"])
def test_public_dispatch_on_cpu(monkeypatch, env, expected):
    """Without the interpreter (which the test session turns on), CPU tensors run the C++ kernel's
    module, unless the reference is forced."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    calls = []
    for name, module in (("cpu", cpu), ("reference", reference)):
        real = module.sparse_gemv
        monkeypatch.setattr(module, "sparse_gemv", lambda *a, _n=name, _r=real, **kw: calls.append(_n) or _r(*a, **kw))
    x, w = _problem(1, 20, 30, seed=6)
    torch.testing.assert_close(public.sparse_gemv(x, w, threshold=0.5), reference.sparse_gemv(x, w, threshold=0.5))
    assert calls[0] == expected
