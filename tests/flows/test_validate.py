"""`scalelab validate` on the ci pipeline's workdir: predictions written before training, then scored."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import polars as pl
import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_validate_preregisters_then_scores_a_larger_run(ci_run, tmp_path: Path):
    from flows.validate import validate_flow

    workdir = Path(shutil.copytree(ci_run[0], tmp_path / "wd", ignore=shutil.ignore_patterns(".prefect")))
    table = validate_flow(root=str(ROOT), preset="ci", workdir=str(workdir))
    out = workdir / "reports" / "validation"
    prediction = json.loads((out / "predictions.json").read_text())
    assert prediction["run"].startswith("d96_l2_") and prediction["run_sd"] is not None
    assert {p["variant"] for p in prediction["predictions"]} == {"dedup_gopher", "raw+repb"}
    rows = pl.read_csv(out / "validation.csv")
    assert rows.height == 2 and set(rows["variant"]) == {"dedup_gopher", "raw+repb"}
    for r in rows.iter_rows(named=True):
        assert r["predicted_pi_low"] <= r["predicted_ci_low"] <= r["predicted"] <= r["predicted_ci_high"] <= r["predicted_pi_high"]
        assert r["hit"] == (r["predicted_pi_low"] <= r["observed"] <= r["predicted_pi_high"])
    assert len(table) == 2
    # a second call scores against the prediction written first, not a new one
    written = prediction["written_at"]
    validate_flow(root=str(ROOT), preset="ci", workdir=str(workdir))
    assert json.loads((out / "predictions.json").read_text())["written_at"] == written


def test_validate_refuses_a_prediction_for_another_run(ci_run, tmp_path: Path):
    from flows.validate import PREDICTIONS, validate_flow

    workdir = Path(shutil.copytree(ci_run[0], tmp_path / "wd", ignore=shutil.ignore_patterns(".prefect")))
    out = workdir / "reports" / "validation"
    out.mkdir(parents=True)
    (out / PREDICTIONS).write_text(json.dumps({"run": "d8_l1_D1", "written_at": "then", "predictions": []}))
    with pytest.raises(ValueError, match="pre-registered for d8_l1_D1"):
        validate_flow(root=str(ROOT), preset="ci", workdir=str(workdir))
