"""kernels.sparse_attention.cpu: the batched CPU path against the query-by-query definition, on every
case of test_sparse_attention (odd sizes, KV prefixes, per-KV-head and per-query-head lists, a query
with no allowed key), with and without a padding mask, and however problems are bucketed."""

from __future__ import annotations

import pytest
import torch

from kernels.sparse_attention import cpu
from kernel_support import rel_err
from test_sparse_attention import OPS, TOL, _call, _cases, _dense_definition, _problem


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("op", OPS)
def test_cpu_matches_the_definition(op, masked):
    for i, case in enumerate(_cases(op)):
        q, k, v, lists, mask = _problem(op, case, seed=20 + i, masked=masked)
        y = _call(cpu, op, q, k, v, lists, case.size, 0.3, mask)
        assert y.shape == q.shape and not torch.isnan(y).any(), case
        assert rel_err(y, _dense_definition(op, q, k, v, lists, case.size, 0.3, mask)) <= 1e-5, case


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_cpu_half_inputs_return_their_dtype(dtype):
    case = _cases("gathered")[0]
    q, k, v, lists, mask = _problem("gathered", case, dtype=dtype, seed=3, masked=True)
    y = _call(cpu, "gathered", q, k, v, lists, case.size, 0.3, mask)
    assert y.dtype == dtype
    ref = _dense_definition("gathered", q.float(), k.float(), v.float(), lists, case.size, 0.3, mask)
    assert rel_err(y, ref) <= TOL[dtype]


@pytest.mark.parametrize(("budget", "spread"), [(1, 1.25), (1 << 22, 1.0), (1 << 22, 100.0)],
                         ids=["one-problem-per-call", "equal-lengths-only", "one-bucket"])
def test_how_problems_are_bucketed_does_not_change_the_result(monkeypatch, budget, spread):
    """SCORES_BUDGET and SPREAD only decide which problems share a call and how far lists are padded."""
    case = _cases("gathered")[4]
    q, k, v, lists, mask = _problem("gathered", case, seed=5, masked=True)
    whole = _call(cpu, "gathered", q, k, v, lists, case.size, 0.3, mask)
    monkeypatch.setattr(cpu, "SCORES_BUDGET", budget)
    monkeypatch.setattr(cpu, "SPREAD", spread)
    assert torch.allclose(_call(cpu, "gathered", q, k, v, lists, case.size, 0.3, mask), whole, atol=1e-6)
