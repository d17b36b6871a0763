"""kernels.sparse_attention: QuoKA's gathered attention and ProxyAttn's block-sparse attention,
Triton (interpreted / CUDA) vs the dense-mask torch reference vs a per-query definition written here."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

import kernels.sparse_attention as public
from kernels.sparse_attention import reference
from kernel_support import DEVICE, grid, needs_cuda, rel_err, triton_module

triton_impl, needs_triton = triton_module("sparse_attention")

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
OPS = ["gathered", "block_sparse"]


@dataclass(frozen=True)
class Case:
    """One problem: ``size`` is the chunk (gathered) or block (block-sparse) size, ``m`` the list
    length, ``per`` whether lists are per KV head or per query head."""

    b: int
    hq: int
    hkv: int
    nq: int
    n: int
    d: int
    size: int
    m: int
    per: str = "kv"

    def __str__(self) -> str:
        return (f"b{self.b}_h{self.hq}x{self.hkv}_{self.per}lists_nq{self.nq}_n{self.n}_d{self.d}"
                f"_size{self.size}_m{self.m}")


# Odd sizes: nq not a multiple of the chunk / block, a KV prefix before the queries (n > nq),
# a chunk larger than nq, non-power-of-two chunks and blocks, head dims 8 / 16 / 64 / 80.
GATHERED = [
    Case(1, 6, 2, 37, 53, 16, 16, 30),
    Case(1, 6, 2, 33, 33, 8, 8, 20, per="q"),
    Case(2, 2, 2, 21, 40, 64, 10, 25),
    Case(1, 3, 3, 19, 19, 80, 32, 12, per="q"),
    Case(1, 4, 1, 45, 70, 16, 20, 70),
]
BLOCK_SPARSE = [
    Case(1, 6, 2, 37, 53, 16, 16, 3),
    Case(1, 6, 2, 33, 33, 8, 8, 4, per="q"),
    Case(2, 2, 2, 21, 40, 64, 12, 3),
    Case(1, 3, 3, 19, 19, 80, 16, 2, per="q"),
    Case(1, 4, 1, 45, 70, 16, 5, 14),
]


def _units(op: str, c: Case) -> int:
    """What a list names: key positions, or key blocks."""
    return c.n if op == "gathered" else -(-c.n // c.size)


def _problem(op: str, c: Case, dtype=torch.float32, seed=0, device="cpu", masked=False):
    """q, k, v, lists, mask. Lists are unsorted, duplicate-free, reach past the causal frontier, end in
    -1 padding, and the first list is all padding: its queries have no allowed key."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(c.b, c.hq, c.nq, c.d, generator=g).to(dtype)
    k = torch.randn(c.b, c.hkv, c.n, c.d, generator=g).to(dtype)
    v = torch.randn(c.b, c.hkv, c.n, c.d, generator=g).to(dtype)
    hs = c.hkv if c.per == "kv" else c.hq
    units, n_groups = _units(op, c), -(-c.nq // c.size)
    rows = []
    for _ in range(c.b * hs * n_groups):
        take = int(torch.randint(max(1, c.m // 2), c.m + 1, (), generator=g))
        listed = torch.randperm(units, generator=g)[: min(take, units)]
        rows.append(torch.cat([listed, torch.full((c.m - len(listed),), -1)]))
    lists = torch.stack(rows).view(c.b, hs, n_groups, c.m)
    lists[0, 0, 0] = -1
    mask = None
    if masked:  # a model's padding mask: batch 0 left-padded by 3 positions, small finite terms elsewhere
        mask = 0.5 * torch.randn(c.b, 1, c.nq, c.n, generator=g)
        mask[0, :, :, :3] = -math.inf
        mask[-1, :, c.nq // 2] = -math.inf  # one query whose every pair is removed
        mask = mask.to(dtype)
    return tuple(t.to(device) if t is not None else None for t in (q, k, v, lists, mask))


def _dense_definition(op: str, q, k, v, lists, size: int, scaling: float, mask=None) -> torch.Tensor:
    """The ops' definition, query by query, independently of both implementations: the positions a
    query's list names, those at or before the query, a softmax over them (none: zeros)."""
    b, hq, nq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    groups = hq // hkv
    out = torch.zeros(b, hq, nq, d)
    for bi in range(b):
        for h in range(hq):
            hs, kvh = (h if lists.shape[1] == hq else h // groups), h // groups
            for t in range(nq):
                entries = [int(e) for e in lists[bi, hs, t // size] if e >= 0]
                if op == "block_sparse":
                    entries = [u for e in entries for u in range(e * size, min((e + 1) * size, n))]
                pos = [u for u in entries if u <= n - nq + t]
                if not pos:
                    continue
                s = (k[bi, kvh, pos].float() @ q[bi, h, t].float()) * scaling
                if mask is not None:
                    s = s + mask[bi, 0, t, pos].float()
                if torch.isneginf(s).all():
                    continue
                out[bi, h, t] = torch.softmax(s, 0) @ v[bi, kvh, pos].float()
    return out


def _call(impl, op: str, q, k, v, lists, size: int, scaling: float, mask=None, **tiles):
    if op == "gathered":
        return impl.gathered_attention(q, k, v, lists, chunk_size=size, scaling=scaling, mask=mask, **tiles)
    return impl.block_sparse_attention(q, k, v, lists, block_size=size, scaling=scaling, mask=mask, **tiles)


def _cases(op: str) -> list[Case]:
    return GATHERED if op == "gathered" else BLOCK_SPARSE


def _op_cases():
    return [pytest.param(op, c, id=f"{op}-{c}") for op in OPS for c in _cases(op)]


def _assert_cleared_list_gives_zeros(y: torch.Tensor, c: Case) -> None:
    """The queries of the first chunk / block of the query heads that read list 0 of batch 0 (cleared
    by :func:`_problem`) have no allowed key: exactly zero, not NaN."""
    heads = c.hq // c.hkv if c.per == "kv" else 1
    rows = y[0, :heads, : min(c.size, c.nq)].cpu()
    assert torch.equal(rows, torch.zeros_like(rows))


@pytest.mark.parametrize(("op", "case"), _op_cases())
def test_reference_matches_dense_definition(op, case):
    for masked in (False, True):
        q, k, v, lists, mask = _problem(op, case, seed=1, masked=masked)
        y = _call(reference, op, q, k, v, lists, case.size, case.d ** -0.5, mask)
        y_def = _dense_definition(op, q, k, v, lists, case.size, case.d ** -0.5, mask)
        assert y.shape == (case.b, case.hq, case.nq, case.d) and not torch.isnan(y).any()
        assert rel_err(y, y_def) <= 1e-5
        _assert_cleared_list_gives_zeros(y, case)


def test_block_lists_are_gathered_lists_of_their_positions():
    """A block list is the gathered list of its blocks' positions (chunk = block): both references agree."""
    c = BLOCK_SPARSE[0]
    q, k, v, blocks, _ = _problem("block_sparse", c, seed=2)
    pos = blocks[..., None] * c.size + torch.arange(c.size)
    keys = torch.where((blocks[..., None] >= 0) & (pos < c.n), pos, -1).flatten(-2)
    y_blocks = reference.block_sparse_attention(q, k, v, blocks, block_size=c.size, scaling=0.3)
    y_keys = reference.gathered_attention(q, k, v, keys, chunk_size=c.size, scaling=0.3)
    assert rel_err(y_blocks, y_keys) <= 1e-6


def _fp32_cases():
    """Every op x case; in the interpreter the block-sparse 45x70 case with blocks of 5 (14 listed, the
    slowest, ~6 s) is -m slow: the four other block-sparse cases cover its odd sizes fast."""
    cases = [(op, c) for op in OPS for c in _cases(op)]
    ids = [f"{op}-{c}" for op, c in cases]
    return grid(cases, ids, set(ids) - {f"block_sparse-{BLOCK_SPARSE[4]}"})


@needs_triton
@pytest.mark.parametrize(("op", "case"), _fp32_cases())
def test_triton_matches_reference_fp32(op, case, poison_empty):
    q, k, v, lists, _ = _problem(op, case, seed=3, device=DEVICE)
    y = _call(triton_impl, op, q, k, v, lists, case.size, case.d ** -0.5)
    assert y.shape == (case.b, case.hq, case.nq, case.d) and y.dtype == torch.float32
    assert not torch.isnan(y).any()
    assert rel_err(y, _call(reference, op, q, k, v, lists, case.size, case.d ** -0.5)) <= TOL[torch.float32]
    _assert_cleared_list_gives_zeros(y, case)


@needs_triton
@pytest.mark.parametrize("op", OPS)
def test_triton_padding_anywhere_in_a_list(op, poison_empty):
    """-1 entries between listed keys / blocks, not only at the end, are skipped too."""
    case = _cases(op)[4]
    q, k, v, lists, _ = _problem(op, case, seed=11)
    g = torch.Generator().manual_seed(11)
    lists = torch.gather(lists, 3, torch.argsort(torch.rand(lists.shape, generator=g), dim=-1))
    assert (lists[..., -1] >= 0).any() and (lists[..., :-1] < 0).any()
    y = _call(triton_impl, op, q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), lists.to(DEVICE), case.size, 0.25)
    assert rel_err(y.cpu(), _call(reference, op, q, k, v, lists, case.size, 0.25)) <= TOL[torch.float32]


@needs_triton
@pytest.mark.parametrize("op", OPS)
def test_triton_additive_mask(op, poison_empty):
    """Padding (-inf) removes pairs, finite entries shift scores, a fully masked query gives zeros."""
    case = _cases(op)[2]  # batch 2: the last batch's middle query is fully masked
    q, k, v, lists, mask = _problem(op, case, seed=4, device=DEVICE, masked=True)
    y = _call(triton_impl, op, q, k, v, lists, case.size, 0.2, mask)
    assert not torch.isnan(y).any()
    y_ref = _call(reference, op, q, k, v, lists, case.size, 0.2, mask)
    assert rel_err(y, y_ref) <= TOL[torch.float32]
    assert torch.equal(y[-1, :, case.nq // 2].cpu(), torch.zeros(case.hq, case.d))
    assert rel_err(y_ref, _call(reference, op, q, k, v, lists, case.size, 0.2)) > 0.05  # the mask mattered


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("op", OPS)
def test_triton_matches_reference_half_dtypes(op, dtype, poison_empty):
    case = _cases(op)[0]
    q, k, v, lists, mask = _problem(op, case, dtype=dtype, seed=5, device=DEVICE, masked=True)
    y = _call(triton_impl, op, q, k, v, lists, case.size, case.d ** -0.5, mask)
    assert y.dtype == dtype
    assert rel_err(y, _call(reference, op, q, k, v, lists, case.size, case.d ** -0.5, mask)) <= TOL[dtype]


TILE_CASES = [(op, t) for op in OPS for t in ((16, 16), (32, 64), (64, 32))]


@needs_triton
@pytest.mark.parametrize(("op", "tiles"), grid(TILE_CASES, [f"{op}-bm{t[0]}_bn{t[1]}" for op, t in TILE_CASES],
                                               {"gathered-bm16_bn16", "gathered-bm32_bn64", "gathered-bm64_bn32",
                                                "block_sparse-bm16_bn16"}))
def test_triton_tile_sizes_agree(op, tiles, poison_empty):
    case = _cases(op)[4]
    q, k, v, lists, _ = _problem(op, case, seed=6, device=DEVICE)
    y = _call(triton_impl, op, q, k, v, lists, case.size, 0.25, block_m=tiles[0], block_n=tiles[1])
    assert rel_err(y, _call(reference, op, q, k, v, lists, case.size, 0.25)) <= TOL[torch.float32]


@needs_triton
@pytest.mark.parametrize("op", OPS)
def test_triton_strided_inputs(op, poison_empty):
    """q, k, v as transformers holds them before its transpose: (b, positions, heads, d) viewed as (b, heads, positions, d)."""
    case = _cases(op)[0]
    q, k, v, lists, _ = _problem(op, case, seed=7, device=DEVICE)
    qs, ks, vs = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert not qs.is_contiguous()
    y = _call(triton_impl, op, qs, ks, vs, lists.to(torch.int32), case.size, 0.25)
    assert rel_err(y, _call(reference, op, q, k, v, lists, case.size, 0.25)) <= TOL[torch.float32]


@needs_triton
@pytest.mark.parametrize("op", OPS)
def test_triton_never_reads_unlisted_keys(op):
    """NaN in the K and V rows that no list names: any read of one would poison the output.
    (The reference multiplies dense matrices, so it reads them by construction.)"""
    case = _cases(op)[0]
    q, k, v, lists, _ = _problem(op, case, seed=8)
    g = torch.Generator().manual_seed(8)
    evens = torch.arange(0, _units(op, case), 2)  # lists name only even positions / blocks
    m = min(case.m, len(evens))
    lists = torch.stack([torch.cat([evens[torch.randperm(len(evens), generator=g)[: m - 1]], torch.tensor([-1])])
                         for _ in range(lists[..., 0].numel())]).view(*lists.shape[:3], m)
    block = case.size if op == "block_sparse" else 1
    unread = (torch.arange(case.n) // block) % 2 == 1
    kp, vp = k.clone(), v.clone()
    kp[:, :, unread] = math.nan
    vp[:, :, unread] = math.nan
    y = _call(triton_impl, op, q.to(DEVICE), kp.to(DEVICE), vp.to(DEVICE), lists.to(DEVICE), case.size, 0.25)
    assert not torch.isnan(y).any()
    assert rel_err(y.cpu(), _dense_definition(op, q, k, v, lists, case.size, 0.25)) <= 1e-5


@pytest.mark.parametrize("route", ["default", "cpu", "reference"])
@pytest.mark.parametrize("op", OPS)
def test_public_function_on_cpu_agrees_with_reference(op, route, monkeypatch):
    """kernels.sparse_attention dispatches (interpreter, CPU kernel or reference) and agrees with the reference."""
    if route != "default":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        monkeypatch.delenv("SCALELAB_TRITON", raising=False)
    if route == "reference":
        monkeypatch.setenv("SCALELAB_TRITON", "reference")
    case = _cases(op)[1]
    q, k, v, lists, mask = _problem(op, case, seed=9, masked=True)
    expected = {"cpu": "kernels.sparse_attention.cpu", "reference": "kernels.sparse_attention.reference"}
    if route in expected:
        assert public._module(q).__name__ == expected[route]
    y = _call(public, op, q, k, v, lists, case.size, 0.3, mask)
    assert y.shape == q.shape and y.dtype == q.dtype and not torch.isnan(y).any()
    assert rel_err(y, _call(reference, op, q, k, v, lists, case.size, 0.3, mask)) <= TOL[torch.float32]


def _bad_inputs():
    """(id, op, overrides, message): each override breaks one argument of a valid problem."""
    c = Case(1, 6, 2, 10, 12, 8, 4, 3)
    return c, [
        ("q_rank", "gathered", {"q": torch.zeros(6, 10, 8)}, "q: expected rank 4"),
        ("k_rank", "block_sparse", {"k": torch.zeros(1, 2, 12)}, "k: expected rank 4"),
        ("v_shape", "gathered", {"v": torch.zeros(1, 2, 11, 8)}, "v: expected the shape of k"),
        ("k_head_dim", "gathered", {"k": torch.zeros(1, 2, 12, 16), "v": torch.zeros(1, 2, 12, 16)}, "k: expected"),
        ("hq_not_multiple", "gathered", {"k": torch.zeros(1, 4, 12, 8), "v": torch.zeros(1, 4, 12, 8)},
         "q: the number of query heads 6 must be a multiple"),
        ("nq_gt_n", "gathered", {"q": torch.zeros(1, 6, 13, 8), "lists": torch.zeros(1, 2, 4, 3, dtype=torch.long)},
         "q: 13 queries"),
        ("lists_rank", "gathered", {"lists": torch.zeros(1, 2, 3, dtype=torch.long)}, "keys: expected rank 4"),
        ("lists_heads", "gathered", {"lists": torch.zeros(1, 3, 3, 3, dtype=torch.long)}, "keys: expected 2 .KV. or 6"),
        ("lists_heads", "block_sparse", {"lists": torch.zeros(1, 4, 3, 3, dtype=torch.long)}, "blocks: expected 2 .KV. or 6"),
        ("n_chunks", "gathered", {"lists": torch.zeros(1, 2, 2, 3, dtype=torch.long)}, "keys: expected ceil"),
        ("n_qblocks", "block_sparse", {"lists": torch.zeros(1, 6, 4, 3, dtype=torch.long)}, "blocks: expected ceil"),
        ("key_ge_n", "gathered", {"lists": torch.tensor([0, 12, -1]).expand(1, 2, 3, 3)}, "keys: values"),
        ("key_lt_minus1", "gathered", {"lists": torch.tensor([0, -2, -1]).expand(1, 2, 3, 3)}, "keys: values"),
        ("block_ge_n_blocks", "block_sparse", {"lists": torch.tensor([0, 3, -1]).expand(1, 2, 3, 3)}, "blocks: values"),
        ("float_lists", "gathered", {"lists": torch.zeros(1, 2, 3, 3)}, "keys: expected an integer dtype"),
        ("chunk_size_0", "gathered", {"size": 0}, "chunk_size: expected an int >= 1"),
        ("block_size_0", "block_sparse", {"size": 0}, "block_size: expected an int >= 1"),
        ("mask_shape", "gathered", {"mask": torch.zeros(1, 6, 10, 12)}, "mask: expected"),
        ("dtype", "gathered", {"k": torch.zeros(1, 2, 12, 8, dtype=torch.float16)}, "k, v: expected q's dtype"),
    ]


_BAD_CASE, _BAD = _bad_inputs()


@pytest.mark.parametrize("impl", ["public", "reference", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize(("op", "overrides", "message"), [pytest.param(*b[1:], id=f"{b[1]}-{b[0]}") for b in _BAD])
def test_bad_input_is_a_value_error_naming_the_argument(op, overrides, message, impl):
    q, k, v, lists, _ = _problem(op, _BAD_CASE)
    args = {"q": q, "k": k, "v": v, "lists": lists, "size": _BAD_CASE.size, "mask": None} | overrides
    module = {"public": public, "reference": reference, "triton": triton_impl}[impl]
    with pytest.raises(ValueError, match=message):
        _call(module, op, args["q"], args["k"], args["v"], args["lists"], args["size"], 0.3, args["mask"])


@needs_triton
def test_triton_tile_sizes_must_be_powers_of_two():
    q, k, v, lists, _ = _problem("gathered", _BAD_CASE)
    with pytest.raises(ValueError, match="block_m: expected a power of two"):
        triton_impl.gathered_attention(q, k, v, lists, chunk_size=4, scaling=0.3, block_m=24)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_cuda_prefill_size(op):
    """A 2k prefill with 32 query / 8 KV heads, head dim 128, fp16, against the reference."""
    c = Case(1, 32, 8, 2048, 2048, 128, 128 if op == "gathered" else 64, 512 if op == "gathered" else 8)
    q, k, v, lists, _ = _problem(op, c, dtype=torch.float16, seed=10, device="cuda")
    y = _call(triton_impl, op, q, k, v, lists, c.size, c.d ** -0.5)
    assert rel_err(y, _call(reference, op, q, k, v, lists, c.size, c.d ** -0.5)) <= TOL[torch.float16]

