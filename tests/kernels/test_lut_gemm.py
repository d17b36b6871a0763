"""kernels.lut_gemm: codebook (NuBitQ) and uniform-grid (RTN) dequantize-and-multiply — Triton (interpreted on
CPU, compiled on CUDA) against the fp32 reference, and the reference against the weights that
tasks.compression.nubitq / rtn dequantize."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from kernels import lut_gemm as public
from kernels.group_quant import pack_codes
from kernels.lut_gemm import reference
from kernel_support import CUDA, DEVICE, grid, needs_cuda, rel_err, triton_module

triton_impl, needs_triton = triton_module("lut_gemm")


_rel_err = functools.partial(rel_err, floor_per_elem=1e-2)


def _task(name: str):
    """tasks.compression.<name>, or a skip where the project's dependencies are missing (a bare GPU
    machine: tasks imports polars); the kernel tests below need only torch and Triton."""
    return pytest.importorskip(f"tasks.compression.{name}", reason="tasks.compression needs the project's dependencies")


def _decoders():
    """tasks.zoo.decoders (how stored codes become weights), or a skip as :func:`_task`."""
    return pytest.importorskip("tasks.zoo.decoders", reason="tasks needs the project's dependencies")


@functools.cache
def _nubitq(out_f: int, in_f: int, bits: int, scope: str, group_size: int, seed: int = 0):
    """NuBitQ's stored tensors for one weight (codes, codebook, row_scale or None) and the meta entry
    its dequantizer reads: Lloyd codebooks fitted by tasks.compression.nubitq itself."""
    nubitq = _task("nubitq")
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * 0.05 + 0.01 * torch.randn(out_f, 1, generator=g)
    imp = torch.rand(out_f, in_f, generator=g) + 0.1  # activation-style importance
    code = nubitq.fit_layer(w, imp, bits, scope, group_size, iters=3)
    tensors = {"w.codes": pack_codes(code.codes, bits), "w.codebook": code.codebook.half()}
    if code.row_scale is not None:
        tensors["w.row_scale"] = code.row_scale.half()
    meta = {"quantized": {"w": {"shape": [out_f, in_f], "dtype": "float32", "bits": bits, "codebook": scope,
                                "group_size": group_size, "outliers": 0}}, "tied": {}}
    return tensors, meta


@functools.cache
def _stored(out_f: int, in_f: int, bits: int, kind: str, group_size: int, seed: int = 0) -> dict:
    """Stored tensors in NuBitQ's (``row``/``group``/``tensor``) or RTN's (``rtn``, ``rtn_sym``: no zeros)
    layout, with random content: the kernels' arithmetic does not depend on how they were fitted."""
    g = torch.Generator().manual_seed(seed)
    groups = -(-in_f // group_size)
    codes = pack_codes(torch.randint(0, 2**bits, (out_f, in_f), generator=g, dtype=torch.uint8), bits)
    if kind.startswith("rtn"):
        zeros = torch.randint(0, 2**bits, (out_f, groups), generator=g).half()
        return {"qweight": codes, "scales": (torch.rand(out_f, groups, generator=g) * 0.01 + 1e-3).half(),
                "zeros": None if kind == "rtn_sym" else zeros}
    segments = {"row": out_f, "group": out_f * groups, "tensor": 1}[kind]
    book = torch.sort(torch.randn(segments, 2**bits, generator=g), dim=1).values * 0.05
    return {"codes": codes, "codebook": book.half(),
            "row_scale": (torch.rand(out_f, generator=g) + 0.5).half() if kind == "tensor" else None}


def _x(tokens, in_f, dtype, seed=1, device="cpu"):
    return torch.randn(tokens, in_f, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


# (tokens, out, in, group_size): odd widths (codes straddling words, a partial last chunk and group),
# groups that are not a multiple of 32 (the GEMM path only), one row, several tokens.
SHAPES = [(1, 63, 500, 128), (2, 33, 257, 64), (3, 17, 96, 48), (1, 1, 7, 4), (5, 40, 128, 32)]
KINDS = ["row", "group", "tensor", "rtn", "rtn_sym"]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _shape_id(s):
    return "t{}_{}x{}_g{}".format(*s)


def _dtype_id(d):
    return str(d).removeprefix("torch.")


def _call(impl, kind, x, out_f, in_f, bits, gs, device="cpu", **kw):
    """``impl.lut_gemm`` / ``impl.rtn_gemm`` on the stored tensors of ``kind``, moved to ``device``."""
    dev = lambda t: None if t is None else t.to(device)  # noqa: E731
    t = _stored(out_f, in_f, bits, kind, gs)
    if kind.startswith("rtn"):
        return impl.rtn_gemm(dev(x), dev(t["qweight"]), dev(t["scales"]), dev(t["zeros"]), bits=bits, group_size=gs, **kw)
    return impl.lut_gemm(dev(x), dev(t["codes"]), dev(t["codebook"]), bits=bits, scope=kind, group_size=gs,
                         row_scale=dev(t["row_scale"]), **kw)


@pytest.mark.parametrize("bits", [2, 3, 4], ids=lambda b: f"w{b}")
@pytest.mark.parametrize("scope", ["row", "group", "tensor"])
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_reference_matches_nubitq_dequantized_weights(shape, scope, bits):
    tokens, out_f, in_f, gs = shape
    tensors, meta = _nubitq(out_f, in_f, bits, scope, gs)
    w = _decoders().nubitq_state(tensors, meta)["w"]
    x = _x(tokens, in_f, torch.float32)
    y = reference.lut_gemm(x, tensors["w.codes"], tensors["w.codebook"], bits=bits, scope=scope, group_size=gs,
                           row_scale=tensors.get("w.row_scale"))
    assert y.shape == (tokens, out_f)
    assert _rel_err(y, x @ w.t()) <= 1e-6


RTN_MODELS = [(b, sym) for b in (2, 3, 4, 8) for sym in (False, True)]


@pytest.mark.parametrize(("bits", "symmetric"), grid(RTN_MODELS, [f"w{b}-{'sym' if s else 'asym'}" for b, s in RTN_MODELS],
                                                     {"w3-asym", "w4-sym", "w8-asym"}))
def test_public_entry_matches_an_rtn_compressed_model(bits, symmetric):
    """The tensors compress_rtn stores, multiplied through the public entry point (the interpreter here,
    CUDA when present), against the state dict rtn's dequantizer rebuilds."""
    rtn = _task("rtn")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(100, 40, bias=False), nn.Linear(40, 33, bias=False))
    cm = rtn.compress_rtn(model, rtn.RTNConfig(bits=bits, group_size=32, symmetric=symmetric, skip=()))
    state = _decoders().grouped_int_state(cm.tensors, cm.meta)
    for name, in_f in (("0", 100), ("1", 40)):
        key = f"{name}.weight"
        x = _x(2, in_f, torch.float32, seed=int(name) + 2)
        zeros = cm.tensors.get(f"{key}.zeros")
        y = public.rtn_gemm(x.to(DEVICE), cm.tensors[f"{key}.qweight"].to(DEVICE), cm.tensors[f"{key}.scales"].to(DEVICE),
                            None if zeros is None else zeros.to(DEVICE), bits=bits, group_size=32)
        assert _rel_err(y.cpu(), x @ state[key].t()) <= 1e-5


# Kernel vs reference: fp32 on every shape, kind and path; fp16 on two odd shapes; bf16 once.
CASES = [(s, k, b, torch.float32) for s in SHAPES[:3] for k in KINDS for b in (2, 3, 4)] + [
    (s, k, 3, torch.float32) for s in SHAPES[3:] for k in KINDS
] + [(s, k, 3, torch.float16) for s in SHAPES[:2] for k in KINDS] + [(SHAPES[0], "row", 4, torch.bfloat16)]
CASE_IDS = [f"{_shape_id(s)}-{k}-w{b}-{_dtype_id(d)}" for s, k, b, d in CASES]
# In make test (interpreter): every kind at 3 bits on the odd 63x500 shape; 2 and 4 bits with codes
# straddling words (33x257, two tokens); groups of 48 (GEMM only) and a 1x7 weight; fp16 and bf16 once.
FAST_CASES = {*(f"t1_63x500_g128-{k}-w3-float32" for k in KINDS), "t2_33x257_g64-group-w2-float32",
              "t2_33x257_g64-rtn-w4-float32", "t2_33x257_g64-row-w4-float32", "t3_17x96_g48-group-w3-float32",
              "t1_1x7_g4-rtn-w3-float32", "t1_1x7_g4-tensor-w3-float32", "t1_63x500_g128-group-w3-float16",
              "t1_63x500_g128-rtn_sym-w3-float16", "t1_63x500_g128-row-w4-bfloat16"}


@needs_triton
@pytest.mark.parametrize("path", ["gemv", "gemm"])
@pytest.mark.parametrize(("shape", "kind", "bits", "dtype"), grid(CASES, CASE_IDS, FAST_CASES))
def test_triton_matches_reference(shape, kind, bits, dtype, path, poison_empty):
    tokens, out_f, in_f, gs = shape
    if path == "gemv" and gs % 32 and kind not in ("row", "tensor"):
        pytest.skip("the GEMV needs groups of a multiple of 32 channels (auto sends these to the GEMM)")
    x = _x(tokens, in_f, dtype)
    y = _call(triton_impl, kind, x, out_f, in_f, bits, gs, device=DEVICE, path=path)
    y_ref = _call(reference, kind, x, out_f, in_f, bits, gs)
    assert y.shape == (tokens, out_f) and y.dtype == dtype
    assert not torch.isnan(y).any()
    assert _rel_err(y.cpu(), y_ref) <= TOL[dtype]


@needs_triton
@pytest.mark.parametrize("bits", [1, 5, 6, 7, 8], ids=lambda b: f"w{b}")
@pytest.mark.parametrize("path", ["gemv", "gemm"])
def test_every_code_width(bits, path, poison_empty):
    """Random codes of every width 1..8 (5, 6 and 7 bits straddle words differently from 3)."""
    g = torch.Generator().manual_seed(bits)
    rows, cols = 19, 100
    q = torch.randint(0, 2**bits, (rows, cols), generator=g, dtype=torch.uint8)
    book = torch.randn(rows, 2**bits, generator=g).half()
    x = _x(1, cols, torch.float32, seed=bits)
    args = [t.to(DEVICE) for t in (x, pack_codes(q, bits), book)]
    y = triton_impl.lut_gemm(*args, bits=bits, scope="row", path=path)
    expected = x @ torch.gather(book.float(), 1, q.long()).t()
    assert _rel_err(y.cpu(), expected) <= 1e-5


SPLITS = [
    ("gemv", "gemv_bn32_bc2_split3", lambda: triton_impl.GemvTiles(block_n=32, block_c=2, split_k=3)),
    ("gemv", "gemv_bn16_bc2_split3", lambda: triton_impl.GemvTiles(block_n=16, block_c=2, split_k=3)),
    ("gemm", "gemm_bm16_bn16_bc16_split2", lambda: triton_impl.GemmTiles(block_m=16, block_n=16, block_c=16, split_k=2)),
]


SPLIT_CASES = [(p, t, k) for p, _, t in SPLITS for k in ("group", "rtn")]


@needs_triton
@pytest.mark.parametrize(("path", "tiles", "kind"), grid(SPLIT_CASES, [f"{i}-{k}" for _, i, _ in SPLITS for k in ("group", "rtn")],
                                                         {"gemv_bn32_bc2_split3-group", "gemv_bn32_bc2_split3-rtn",
                                                          "gemm_bm16_bn16_bc16_split2-group",
                                                          "gemm_bm16_bn16_bc16_split2-rtn"}))
def test_split_k_and_tile_sizes_agree(path, tiles, kind, poison_empty):
    """K split over programs, run twice (the arrival counters reset); two tokens and two row blocks."""
    in_f = 192 if path == "gemv" else 1100
    x = _x(2, in_f, torch.float32, seed=5)
    y_ref = _call(reference, kind, x, 20, in_f, 3, 64)
    for _ in range(2):
        y = _call(triton_impl, kind, x, 20, in_f, 3, 64, device=DEVICE, path=path, tiles=tiles())
        assert _rel_err(y.cpu(), y_ref) <= 1e-5


def test_leading_dims_and_vector_input():
    t = _stored(33, 257, 3, "row", 64)
    x = _x(6, 257, torch.float32, seed=7)
    y = public.lut_gemm(x.view(2, 3, 257), t["codes"], t["codebook"], bits=3)
    assert y.shape == (2, 3, 33)
    expected = reference.lut_gemm(x, t["codes"], t["codebook"], bits=3)
    torch.testing.assert_close(y.view(6, 33), expected, rtol=1e-5, atol=1e-6)
    y1 = public.lut_gemm(x[0], t["codes"], t["codebook"], bits=3)
    assert y1.shape == (33,)
    torch.testing.assert_close(y1, expected[0], rtol=1e-5, atol=1e-6)


def test_bad_inputs_are_refused():
    t = _stored(63, 500, 3, "tensor", 128)
    codes, book, rs = t["codes"], t["codebook"], t["row_scale"]
    x = _x(1, 500, torch.float32)
    with pytest.raises(ValueError, match="codes"):
        reference.lut_gemm(_x(1, 520, torch.float32), codes, book, bits=3, scope="tensor", row_scale=rs)
    with pytest.raises(ValueError, match="codebook"):
        reference.lut_gemm(x, codes, book, bits=3, scope="row")  # a tensor codebook is not one per row
    with pytest.raises(ValueError, match="row_scale"):
        reference.lut_gemm(x, codes, book, bits=3, scope="tensor")
    with pytest.raises(ValueError, match="scope"):
        reference.lut_gemm(x, codes, book, bits=3, scope="channel", row_scale=rs)
    with pytest.raises(ValueError, match="bits"):
        reference.lut_gemm(x, codes, book, bits=9, scope="tensor", row_scale=rs)
    r = _stored(63, 500, 4, "rtn", 128)
    q, s, z = r["qweight"], r["scales"], r["zeros"]
    with pytest.raises(ValueError, match="zeros"):
        reference.rtn_gemm(x, q, s, z[:, :1], bits=4, group_size=128)
    with pytest.raises(ValueError, match="scales"):
        reference.rtn_gemm(x, q, s, z, bits=4, group_size=64)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16])
@pytest.mark.parametrize("kind", ["row", "group", "tensor", "rtn"])
@pytest.mark.parametrize("shape", [(4096, 4096), (4096, 11008)], ids=lambda s: "x".join(map(str, s)))
def test_cuda_llm_sizes(shape, kind, tokens):
    out_f, in_f = shape
    g = torch.Generator().manual_seed(3)
    bits, gs = (4, 128) if kind == "rtn" else (3, 128)
    q = torch.randint(0, 2**bits, (out_f, in_f), generator=g, dtype=torch.uint8)
    codes = pack_codes(q, bits).cuda()
    x = torch.randn(tokens, in_f, generator=g).half().cuda()
    if kind == "rtn":
        s = (torch.rand(out_f, in_f // gs, generator=g) * 0.01).half().cuda()
        z = torch.randint(0, 16, (out_f, in_f // gs), generator=g).half().cuda()
        y, y_ref = (impl.rtn_gemm(x, codes, s, z, bits=bits, group_size=gs) for impl in (triton_impl, reference))
    else:
        segs = {"row": out_f, "group": out_f * in_f // gs, "tensor": 1}[kind]
        book = (torch.randn(segs, 2**bits, generator=g) * 0.02).half().cuda()
        rs = torch.rand(out_f, generator=g).half().cuda() if kind == "tensor" else None
        y, y_ref = (impl.lut_gemm(x, codes, book, bits=bits, scope=kind, group_size=gs, row_scale=rs)
                    for impl in (triton_impl, reference))
    assert _rel_err(y, y_ref) <= TOL[torch.float16]
