"""Fixtures shared by the kernel tests (helpers that are imported live in kernel_support.py)."""

from __future__ import annotations

import math

import pytest
import torch


@pytest.fixture
def poison_empty(monkeypatch):
    """Fresh buffers start as NaN (floats) or 0xFF (ints), so an output element a kernel forgets to write shows."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        t.fill_(math.nan if t.is_floating_point() else 255)
        return t

    monkeypatch.setattr(torch, "empty", empty)
