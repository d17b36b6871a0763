"""Epoch AI's replication of Chinchilla's Approach 3 on their extracted points."""

from pathlib import Path

import numpy as np
import polars as pl
import pytest

from tasks.scaling.chinchilla import bootstrap_chinchilla, fit_chinchilla
from tasks.scaling.compute_optimal import compute_optimal_table
from tasks.scaling.config import FitConfig

REFERENCE = Path(__file__).resolve().parents[3].parent / "shared" / "reference"
CSV = REFERENCE / "chinchilla_epoch_svg_extracted.csv"

pytestmark = pytest.mark.skipif(not CSV.exists(), reason=f"{CSV} is absent (shared reference data)")


@pytest.fixture(scope="module")
def points():
    d = pl.read_csv(CSV)
    N = d["Model Size"].to_numpy()
    return N, d["Training FLOP"].to_numpy() / (6 * N), d["loss"].to_numpy()


def test_reproduces_epoch_fit(points):
    cfg = FitConfig(exclude_top_loss=5, n_starts=32)
    fit = fit_chinchilla(*points, cfg)
    assert fit.n_points == 240 and len(fit.excluded) == 5
    # Epoch: alpha 0.3478 (95% 0.317-0.373), beta 0.3658 (0.331-0.415), E 1.8169
    assert 0.317 <= fit.alpha <= 0.373
    assert 0.331 <= fit.beta <= 0.415
    assert fit.E == pytest.approx(1.8169, abs=0.05)
    # Epoch's implied tokens per parameter at Chinchilla's compute (~5.76e23 FLOPs): ~25.7
    row = compute_optimal_table(fit, [5.76e23])[0]
    assert row["tokens_per_param"] == pytest.approx(25.7, rel=0.15)


def test_bootstrap_intervals_near_epochs(points):
    cfg = FitConfig(exclude_top_loss=5, n_starts=16, n_bootstrap=60, n_jobs=2)
    boot = bootstrap_chinchilla(*points, cfg)
    lo, hi = boot.intervals["alpha"]
    assert 0.30 < lo < boot.point.alpha < hi < 0.39
    lo, hi = boot.intervals["beta"]
    assert 0.31 < lo < boot.point.beta < hi < 0.44
