"""What every kernel test shares: which Triton path can run on this machine, and where.

Each package under ``kernels/`` has a torch reference and a Triton module; the Triton tests run
compiled on CUDA, or in Triton's interpreter on CPU when ``TRITON_INTERPRET=1`` was set before
Triton was imported (tests/conftest.py sets it on machines without CUDA).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest
import torch

import kernels._dispatch as dispatch

CUDA = torch.cuda.is_available()
INTERPRET = dispatch.interpreter_requested()
DEVICE = "cuda" if CUDA else "cpu"

needs_cuda = pytest.mark.skipif(not CUDA, reason="compiled Triton kernels need a CUDA device")


def triton_module(package: str) -> tuple[ModuleType | None, pytest.MarkDecorator]:
    """``kernels.<package>.triton`` (None where Triton is missing) and the skip marker for tests that run it."""
    try:
        module = importlib.import_module(f"kernels.{package}.triton")
    except ImportError:  # pragma: no cover - Triton missing
        module = None
    runnable = module is not None and (CUDA or (INTERPRET and module.INTERPRETED))
    return module, pytest.mark.skipif(
        not runnable,
        reason="needs Triton with CUDA, or TRITON_INTERPRET=1 set before import (tests/conftest.py sets it without CUDA)",
    )


def rel_err(a: torch.Tensor, b: torch.Tensor, floor_per_elem: float = 0.0) -> float:
    """Relative Frobenius error of ``a`` against ``b``. ``floor_per_elem`` > 0 floors the norm of ``b``
    at that times sqrt(numel), so an output that cancels to ~0 (1 x 7 shapes) does not turn fp32
    rounding into a large ratio."""
    floor = max(1e-12, floor_per_elem * b.numel() ** 0.5)
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(floor)).item()


def grid(cases: list, ids: list[str], fast: set[str]) -> list:
    """``pytest.param`` per case, with its id; in Triton's interpreter (CPU: seconds a launch) the cases
    whose id is not in ``fast`` are marked slow, so ``make test`` runs a representative odd-shaped
    subset and ``make test-slow`` the whole grid. Compiled on CUDA every case stays in ``make test``."""
    unknown = fast - set(ids)
    assert not unknown, f"fast cases that are not in the grid: {sorted(unknown)}"
    slow = [pytest.mark.slow] if INTERPRET and not CUDA else []
    return [pytest.param(*(c if isinstance(c, tuple) else (c,)), id=i, marks=[] if i in fast else slow)
            for c, i in zip(cases, ids, strict=True)]
