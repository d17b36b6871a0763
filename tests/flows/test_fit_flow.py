"""gather_points: one N and one C definition, and the runs a law may not use."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from flows.fit import gather_points
from tasks.scaling.config import FitConfig


def _train(tmp_path: Path) -> None:
    pl.DataFrame({
        "variant": ["raw"] * 4, "run": ["r0", "r1", "r2", "r3"], "data_variant": ["raw"] * 4,
        "n_params": [1.0e6, 2.0e6, 4.0e6, 8.0e6],
        "n_params_total": [1.5e6, 2.6e6, 4.8e6, 9.0e6],
        "n_params_nonembed": [1.0e6, 2.0e6, 4.0e6, 8.0e6],
        "tokens": [2e7, 4e7, 8e7, 1.6e8],
        "flops_total": [2.0e14, 7.0e14, 2.5e15, 9.0e15],
        "epochs": [1.0, 1.0, 2.0, 1.0],
        "unique_tokens": [1e8] * 4,
        "diverged": [False, True, False, False],
        "compute_budget": [None, None, 1e15, 1e16],
        "val_loss": [4.0, None, 3.5, 3.2],
    }).write_csv(tmp_path / "train.csv")
    pl.DataFrame({"variant": ["raw", "raw"], "run": ["r0", "r1"], "setting": ["rtn_w4", "rtn_w4"],
                  "n_params": [1.0e6, 2.0e6], "tokens": [2e7, 4e7], "val_loss": [4.1, 3.9]}
                 ).write_csv(tmp_path / "compress.csv")


def test_excludes_diverged_and_multi_epoch_runs_with_reasons(tmp_path: Path):
    _train(tmp_path)
    g = gather_points(tmp_path, FitConfig())
    assert g.n_column == "n_params_total"
    raw = g.points.filter(pl.col("variant") == "raw")
    assert raw["run"].to_list() == ["r0", "r3"]
    assert raw["N"].to_list() == [1.5e6, 9.0e6] and raw["C"].to_list() == [2.0e14, 9.0e15]
    assert raw["compute_budget"].to_list() == [None, 1e16]
    reasons = {(e["variant"], e["run"]): e["reason"] for e in g.excluded_runs}
    assert reasons[("raw", "r1")] == "diverged"
    assert reasons[("raw", "r2")].startswith("epochs=2") and "max_epochs=1" in reasons[("raw", "r2")]
    # the compressed r1 is a compression of a diverged run: left out too, with the same reason
    assert reasons[("raw+rtn_w4", "r1")] == "diverged"
    comp = g.points.filter(pl.col("variant") == "raw+rtn_w4")
    assert comp["N"].to_list() == [1.5e6] and comp["C"].to_list() == [2.0e14]  # joined on (variant, run)
    # non-embedding N on request; max_epochs: null keeps the 2-epoch run
    g2 = gather_points(tmp_path, FitConfig(n_definition="non_embedding", max_epochs=None))
    assert g2.n_column == "n_params_nonembed"
    assert g2.points.filter(pl.col("variant") == "raw")["N"].to_list() == [1.0e6, 4.0e6, 8.0e6]


def test_old_reports_without_new_columns_still_gather(tmp_path: Path):
    pl.DataFrame({"variant": ["raw"] * 2, "run": ["a", "b"], "n_params": [1e6, 2e6], "tokens": [2e7, 4e7],
                  "val_loss": [4.0, 3.8]}).write_csv(tmp_path / "train.csv")
    g = gather_points(tmp_path, FitConfig())
    assert g.n_column == "n_params" and g.excluded_runs == []
    assert g.points.columns == ["variant", "N", "D", "loss", "run", "series"]


def test_compressed_and_sparse_laws_use_derived_n_bootstrap(tmp_path: Path):
    import numpy as np

    from tasks.scaling.report import fit_points

    n = np.repeat([1e6, 3e6, 1e7], 3)
    d = np.tile([2e7, 6e7, 2e8], 3)
    loss = 1.7 + 400 / n**0.34 + 410 / d**0.28
    runs = [f"r{i}" for i in range(9)]
    pl.DataFrame({"variant": ["raw"] * 9, "run": runs, "n_params": n, "tokens": d, "val_loss": loss}
                 ).write_csv(tmp_path / "train.csv")
    pl.DataFrame({"variant": ["raw"] * 9, "run": runs, "setting": ["rtn_w4"] * 9, "n_params": n, "tokens": d,
                  "val_loss": loss * 1.01}).write_csv(tmp_path / "compress.csv")
    g = gather_points(tmp_path, FitConfig())
    assert dict(g.points.group_by("variant").agg(pl.col("series").first()).iter_rows()) == {
        "raw": "trained", "raw+rtn_w4": "compress"}
    cfg = FitConfig(n_bootstrap=6, derived_n_bootstrap=3, backtest_bootstrap=4, n_jobs=1, n_starts=4,
                    bootstrap_n_starts=2, huber_delta_sensitivity=())
    laws = fit_points(g.points, cfg)["variants"]
    assert laws["raw"]["bootstrap"]["n_requested"] == 6
    assert laws["raw+rtn_w4"]["bootstrap"]["n_requested"] == 3


def test_pretrained_models_rows_are_no_points_of_a_law(tmp_path: Path):
    """SmolLM2's rows in compress.csv and sparse_eval.csv (variant ``pretrained``, no run, no tokens)
    are left out; before, the fit stage refused the whole table ("D is empty")."""
    _train(tmp_path)
    pretrained = {"variant": ["pretrained"], "run": [None], "model": ["smollm2-135m"], "n_params": [1.3e8],
                  "tokens": [None], "val_loss": [3.7]}
    pl.DataFrame({**pretrained, "setting": ["rtn_w3_g128"]}).write_csv(tmp_path / "sparse_eval.csv")
    with_smollm2 = pl.concat([pl.read_csv(tmp_path / "compress.csv"), pl.DataFrame({**pretrained, "setting": ["rtn_w3"]})],
                             how="diagonal_relaxed")
    with_smollm2.write_csv(tmp_path / "compress.csv")
    g = gather_points(tmp_path, FitConfig())
    assert not g.points.filter(pl.col("variant").str.starts_with("pretrained")).height
    assert g.points.filter(pl.col("series") == "compress")["variant"].to_list() == ["raw+rtn_w4"]  # r1 diverged
    assert g.points["D"].is_not_null().all()
