"""kernels.bitplane_gemm: AnyBCQ's bit-plane GEMV/GEMM — Triton (interpreted on CPU, compiled on CUDA)
against the fp32 reference, and the reference against the weights tasks.zoo.decoders dequantizes."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from kernels import bitplane_gemm as public
from kernels.bitplane_gemm import reference
from kernel_support import CUDA, DEVICE, INTERPRET, grid, needs_cuda, rel_err, triton_module

triton_impl, needs_triton = triton_module("bitplane_gemm")


_rel_err = functools.partial(rel_err, floor_per_elem=1e-2)


def _anybcq():
    """tasks.compression.anybcq, or a skip where the project's dependencies are missing (a bare GPU
    machine: tasks imports polars); the kernel tests below need only torch and Triton."""
    return pytest.importorskip("tasks.compression.anybcq", reason="tasks.compression needs the project's dependencies")


def _decoders():
    """tasks.zoo.decoders (how stored codes become weights), or a skip as :func:`_anybcq`."""
    return pytest.importorskip("tasks.zoo.decoders", reason="tasks needs the project's dependencies")


@functools.cache
def _stored(out_f: int, in_f: int, group_size: int, offset: bool, seed: int = 0):
    """Stored tensors in AnyBCQ's layout with random content: planes uint8 (4, out, ceil(in / 8)) —
    padding bits random too, which the kernels must ignore — and per precision 2..4
    ``(scales fp16 (out, groups, k), offset fp16 (out, groups) or None)``."""
    g = torch.Generator().manual_seed(seed)
    groups = -(-in_f // group_size)
    planes = torch.randint(0, 256, (4, out_f, (in_f + 7) // 8), generator=g, dtype=torch.uint8)
    stored = {}
    for k in (2, 3, 4):
        a = (torch.rand(out_f, groups, k, generator=g) + 0.5) * 0.05 / 2.0 ** torch.arange(k)  # shrinking planes
        z = (torch.randn(out_f, groups, generator=g) * 0.01).half() if offset else None
        stored[k] = (a.half(), z)
    return planes, stored


@functools.cache
def _artifact(out_f: int, in_f: int, group_size: int, offset: bool, seed: int = 0):
    """What AnyBCQ fits and stores for one weight: packed planes uint8 (4, out, ceil(in / 8)) and, per
    precision 2..4, ``(scales fp16 (out, groups, k), offset fp16 (out, groups) or None)``."""
    anybcq = _anybcq()
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) * 0.05 + 0.01 * torch.randn(out_f, 1, generator=g)
    planes, scales = anybcq.bcq_progressive(w, min_bits=2, max_bits=4, group_size=group_size, iters=2, offset=offset)
    stored = {k: (a.half(), z.half() if offset else None) for k, (a, z) in scales.items()}
    return anybcq.pack_planes(planes), stored


def _anybcq_weight(packed, scales, off, bits, group_size, cols):
    """The weight as tasks.zoo.decoders rebuilds an AnyBCQ artifact's (its own unpacking and formula)."""
    decoders = _decoders()
    planes = decoders.unpack_planes(packed[:bits], cols)
    z = off if off is not None else torch.zeros(scales.shape[:2])
    return decoders.bcq_dequantize(planes, scales, z, group_size=group_size)


def _x(tokens, in_f, dtype, seed=1, device="cpu"):
    return torch.randn(tokens, in_f, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


# (tokens, out, in, group_size, offset): odd widths (a partial last byte, chunk and group), no offset,
# groups that are not a multiple of 32 (GEMM path only), one row, several tokens.
SHAPES = [
    (1, 63, 500, 128, True),
    (2, 33, 257, 64, False),
    (1, 200, 64, 32, True),
    (3, 17, 96, 48, True),
    (1, 1, 7, 2, True),
    (5, 40, 128, 128, True),
]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _shape_id(s):
    return "t{}_{}x{}_g{}{}".format(*s[:4], "" if s[4] else "_nooffset")


def _dtype_id(d):
    return str(d).removeprefix("torch.")


@pytest.mark.parametrize("bits", [2, 3, 4], ids=lambda b: f"w{b}")
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_reference_matches_anybcq_dequantized_weights(shape, bits):
    tokens, out_f, in_f, gs, offset = shape
    packed, stored = _artifact(out_f, in_f, gs, offset)
    scales, off = stored[bits]
    x = _x(tokens, in_f, torch.float32)
    y = reference.bitplane_gemm(x, packed, scales, off, bits=bits, group_size=gs)
    w = _anybcq_weight(packed, scales, off, bits, gs, in_f)
    assert y.shape == (tokens, out_f)
    assert _rel_err(y, x @ w.t()) <= 1e-6


def test_public_entry_matches_a_compressed_model_at_every_precision():
    """The artifact compress_anybcq writes, served at 2, 3 and 4 bits through the public entry point
    (the interpreter here, CUDA when present), against the state dict its dequantizer rebuilds."""
    anybcq = _anybcq()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 40, bias=False), nn.Linear(40, 33, bias=False))
    cfg = anybcq.AnyBCQConfig(bits=3, min_bits=2, max_bits=4, group_size=32, iters=2, skip=(), weighting="none")
    cm = anybcq.compress_anybcq(model, cfg)
    x = {"0": _x(2, 96, torch.float32, seed=2), "1": _x(2, 40, torch.float32, seed=3)}
    errors = []
    for bits in (2, 3, 4):
        state = _decoders().anybcq_state(cm.tensors, cm.meta, bits=bits)
        for name in ("0", "1"):
            key = f"{name}.weight"
            t = {k: v.to(DEVICE) for k, v in cm.tensors.items() if k.startswith(key)}
            y = public.bitplane_gemm(x[name].to(DEVICE), t[f"{key}.planes"], t[f"{key}.scales.{bits}"],
                                     t[f"{key}.offset.{bits}"], bits=bits, group_size=32)
            expected = x[name] @ state[key].t()
            assert _rel_err(y.cpu(), expected) <= 1e-5
            if name == "0":
                errors.append(_rel_err(y.cpu(), x[name] @ model[0].weight.detach().t()))
    assert errors[0] > errors[1] > errors[2]  # one artifact, more planes served, closer to the fp32 layer


# Kernel vs reference: fp32 on every shape, bits and path; fp16 on the odd ones; bf16 once per path.
CASES = [(s, b, torch.float32) for s in SHAPES for b in (2, 3, 4)] + [
    (s, b, torch.float16) for s in SHAPES[:4] for b in (2, 3, 4)
] + [(SHAPES[0], 3, torch.bfloat16), (SHAPES[3], 3, torch.bfloat16)]
CASE_IDS = [f"{_shape_id(s)}-w{b}-{_dtype_id(d)}" for s, b, d in CASES]
# In make test (interpreter): every precision on the odd 63x500 shape; a partial byte with no offset and
# two tokens, groups of 48 (GEMM only), a 1x7 weight at 3 bits; fp16 and bf16 once. The rest: -m slow.
FAST_CASES = {"t1_63x500_g128-w2-float32", "t1_63x500_g128-w3-float32", "t1_63x500_g128-w4-float32",
              "t2_33x257_g64_nooffset-w3-float32", "t3_17x96_g48-w3-float32", "t1_1x7_g2-w3-float32",
              "t1_63x500_g128-w3-float16", "t3_17x96_g48-w3-bfloat16"}


@needs_triton
@pytest.mark.parametrize("path", ["gemv", "gemm"])
@pytest.mark.parametrize(("shape", "bits", "dtype"), grid(CASES, CASE_IDS, FAST_CASES))
def test_triton_matches_reference(shape, bits, dtype, path, poison_empty):
    tokens, out_f, in_f, gs, offset = shape
    if path == "gemv" and gs % 32:
        pytest.skip("the GEMV needs groups of a multiple of 32 channels (auto sends these to the GEMM)")
    packed, stored = _stored(out_f, in_f, gs, offset)
    scales, off = stored[bits]
    x = _x(tokens, in_f, dtype)
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    y = triton_impl.bitplane_gemm(dev(x), dev(packed), dev(scales), dev(off), bits=bits, group_size=gs, path=path)
    y_ref = reference.bitplane_gemm(x, packed, scales, off, bits=bits, group_size=gs)
    assert y.shape == (tokens, out_f) and y.dtype == dtype
    assert not torch.isnan(y).any()
    assert _rel_err(y.cpu(), y_ref) <= TOL[dtype]


SPLITS = [
    ("gemv", "gemv_bn32_bc2_split3", lambda: triton_impl.GemvTiles(block_n=32, block_c=2, split_k=3)),
    ("gemv", "gemv_bn16_bc2_split3", lambda: triton_impl.GemvTiles(block_n=16, block_c=2, split_k=3)),
    ("gemm", "gemm_bm16_bn16_bc16_split2", lambda: triton_impl.GemmTiles(block_m=16, block_n=16, block_c=16, split_k=2)),
]


@needs_triton
@pytest.mark.parametrize(("path", "tiles"), grid([(p, t) for p, _, t in SPLITS], [i for _, i, _ in SPLITS],
                                                 {"gemv_bn32_bc2_split3", "gemm_bm16_bn16_bc16_split2"}))
def test_split_k_and_tile_sizes_agree(path, tiles, poison_empty):
    """K split over programs (the last to arrive sums the slices), run twice: the arrival counters
    must be back at zero after each launch. Two tokens and two row blocks: distinct counters."""
    in_f = 192 if path == "gemv" else 1100  # 6 chunks; the GEMM steps 16 chunks at a time
    packed, stored = _stored(20, in_f, 64, True, seed=4)
    scales, off = stored[3]
    x = _x(2, in_f, torch.float32, seed=5)
    y_ref = reference.bitplane_gemm(x, packed, scales, off, bits=3, group_size=64)
    args = [t.to(DEVICE) for t in (x, packed, scales, off)]
    for _ in range(2):
        y = triton_impl.bitplane_gemm(*args, bits=3, group_size=64, path=path, tiles=tiles())
        assert _rel_err(y.cpu(), y_ref) <= 1e-5


@needs_triton
@pytest.mark.parametrize("bits", [1, 5, 6, 7, 8], ids=lambda b: f"w{b}")
@pytest.mark.parametrize("path", ["gemv", "gemm"])
def test_every_plane_count_up_to_eight(bits, path, poison_empty):
    """Synthetic planes and scales for the precisions the 2..4-bit artifacts above do not reach."""
    g = torch.Generator().manual_seed(bits)
    rows, cols, gs = 21, 160, 32
    packed = torch.randint(0, 256, (8, rows, (cols + 7) // 8), generator=g, dtype=torch.uint8)
    scales = (torch.rand(rows, cols // gs, bits, generator=g) * 0.1).half()
    off = (torch.randn(rows, cols // gs, generator=g) * 0.01).half()
    x = _x(1, cols, torch.float32, seed=bits)
    y = triton_impl.bitplane_gemm(*(t.to(DEVICE) for t in (x, packed, scales, off)), bits=bits, group_size=gs, path=path)
    assert _rel_err(y.cpu(), reference.bitplane_gemm(x, packed, scales, off, bits=bits, group_size=gs)) <= 1e-5


@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=needs_triton)])
def test_only_the_requested_planes_matter(impl):
    """Planes past ``bits`` replaced by their complement: the 2-bit product must not move."""
    packed, stored = _stored(63, 500, 128, True)
    scales, off = stored[2]
    other = packed.clone()
    other[2:] = ~other[2:]
    x = _x(1, 500, torch.float32)
    fn = reference.bitplane_gemm if impl == "reference" else triton_impl.bitplane_gemm
    dev = DEVICE if impl == "triton" else "cpu"
    a = fn(x.to(dev), packed.to(dev), scales.to(dev), off.to(dev), bits=2, group_size=128)
    b = fn(x.to(dev), other.to(dev), scales.to(dev), off.to(dev), bits=2, group_size=128)
    assert torch.equal(a, b)


@needs_triton
def test_word_view_is_zero_copy_for_multiples_of_32():
    packed = torch.randint(0, 256, (3, 5, 8), dtype=torch.uint8)  # 64 columns: 2 words per row
    words = triton_impl.as_words(packed, 2)
    assert words.dtype == torch.int32 and words.shape == (3, 5, 2)
    assert words.data_ptr() == packed.data_ptr()
    odd = triton_impl.as_words(packed[..., :7], 2)  # 50..56 columns: padded copy, same bits
    assert odd.shape == (3, 5, 2)
    assert torch.equal(odd.view(torch.uint8)[..., :7], packed[..., :7])
    assert (odd.view(torch.uint8)[..., 7:] == 0).all()
    # Bit j of a row is bit j % 32 of word j // 32 (little-endian).
    j = 37
    bit_from_bytes = (packed[..., j // 8] >> (j % 8)) & 1
    bit_from_words = (words[..., j // 32] >> (j % 32)) & 1
    assert torch.equal(bit_from_bytes.int(), bit_from_words)


def test_leading_dims_and_vector_input():
    packed, stored = _stored(33, 257, 64, False)
    scales, _ = stored[3]
    x = _x(6, 257, torch.float32, seed=7)
    y = public.bitplane_gemm(x.view(2, 3, 257), packed, scales, None, bits=3, group_size=64)
    assert y.shape == (2, 3, 33)
    expected = reference.bitplane_gemm(x, packed, scales, None, bits=3, group_size=64)
    torch.testing.assert_close(y.view(6, 33), expected, rtol=1e-5, atol=1e-6)
    y1 = public.bitplane_gemm(x[0], packed, scales, None, bits=3, group_size=64)
    assert y1.shape == (33,)
    torch.testing.assert_close(y1, expected[0], rtol=1e-5, atol=1e-6)


def test_bad_inputs_are_refused():
    packed, stored = _stored(63, 500, 128, True)
    scales, off = stored[3]
    x = _x(1, 500, torch.float32)
    with pytest.raises(ValueError, match="bits"):
        reference.bitplane_gemm(x, packed, stored[4][0], off, bits=5, group_size=128)  # 4 planes stored
    with pytest.raises(ValueError, match="scales"):
        reference.bitplane_gemm(x, packed, scales, off, bits=2, group_size=128)  # scales of 3 bits
    with pytest.raises(ValueError, match="planes"):
        reference.bitplane_gemm(_x(1, 520, torch.float32), packed, scales, off, bits=3, group_size=128)
    with pytest.raises(ValueError, match="offset"):
        reference.bitplane_gemm(x, packed, scales, off[:, :2], bits=3, group_size=128)
    if triton_impl is not None and (CUDA or INTERPRET):
        packed48, stored48 = _stored(17, 96, 48, True)
        with pytest.raises(ValueError, match="gemv"):
            triton_impl.bitplane_gemm(_x(1, 96, torch.float32).to(DEVICE), packed48.to(DEVICE),
                                      stored48[2][0].to(DEVICE), stored48[2][1].to(DEVICE), bits=2, group_size=48,
                                      path="gemv")


def test_gemm_steps_stay_inside_a_group():
    if triton_impl is None:
        pytest.skip("Triton is not installed")
    assert triton_impl.step_chunks(128, 4) == 4  # 128 columns per step: one group
    assert triton_impl.step_chunks(64, 4) == 2
    assert triton_impl.step_chunks(96, 4) == 1  # 96 = 3 chunks: only single-chunk steps divide it
    assert triton_impl.step_chunks(48, 4) is None  # a group is not a whole number of chunks


@pytest.mark.slow
@pytest.mark.skipif(triton_impl is None, reason="needs Triton (pip install triton==3.7.1)")
def test_kernels_compile_for_sm90_without_a_gpu():
    """What the interpreter cannot catch: every kernel variant of both packages built to an sm_90
    cubin with Triton's own launch-time specialisation (kernels.bitplane_gemm.compile_check)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "SCALELAB_TRITON")}
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-m", "kernels.bitplane_gemm.compile_check", "--quick"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=900)
    if run.returncode == 2:
        pytest.skip(run.stdout.strip().splitlines()[-1])
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert " 0 failed" in run.stdout


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16])
@pytest.mark.parametrize("bits", [2, 3, 4], ids=lambda b: f"w{b}")
@pytest.mark.parametrize("shape", [(4096, 4096), (4096, 11008), (11008, 4096)], ids=lambda s: "x".join(map(str, s)))
def test_cuda_llm_sizes(shape, bits, tokens):
    out_f, in_f = shape
    g = torch.Generator().manual_seed(bits)
    packed = torch.randint(0, 256, (4, out_f, in_f // 8), generator=g, dtype=torch.uint8).cuda()
    scales = (torch.rand(out_f, in_f // 128, bits, generator=g) * 0.02).half().cuda()
    off = (torch.randn(out_f, in_f // 128, generator=g) * 0.002).half().cuda()
    x = (torch.randn(tokens, in_f, generator=g)).half().cuda()
    y = triton_impl.bitplane_gemm(x, packed, scales, off, bits=bits, group_size=128)
    y_ref = reference.bitplane_gemm(x, packed, scales, off, bits=bits, group_size=128)
    assert _rel_err(y, y_ref) <= TOL[torch.float16]
