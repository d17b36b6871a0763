"""Synthetic ladders drawn from a known L(N, D) = E + A/N^alpha + B/D^beta."""

from __future__ import annotations

import numpy as np
import pytest


def synthetic_ladder(*, E=1.8, A=400.0, B=1500.0, alpha=0.34, beta=0.30, noise=0.005, seed=0,
                     n_sizes=8, n_tokens=6, n_lo=1e7, n_hi=3e9):
    """Runs on a grid of model sizes x tokens-per-parameter, log-normal noise of sd ``noise``."""
    rng = np.random.default_rng(seed)
    N = np.repeat(np.geomspace(n_lo, n_hi, n_sizes), n_tokens)
    ratio = np.tile(np.geomspace(2, 200, n_tokens), n_sizes)
    D = N * ratio
    loss = (E + A / N**alpha + B / D**beta) * np.exp(noise * rng.standard_normal(N.size))
    return N, D, loss


@pytest.fixture
def ladder():
    """The :func:`synthetic_ladder` factory."""
    return synthetic_ladder
