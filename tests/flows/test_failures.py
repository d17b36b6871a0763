"""A failed stage marks its MLflow run FAILED with the error, and no run is left RUNNING."""

from __future__ import annotations

from pathlib import Path

import mlflow
import pytest

from flows.fit import fit_flow
from tasks.common.tracking import tracking_uri

ROOT = Path(__file__).resolve().parents[2]


def test_stage_failure_is_recorded_on_its_run(prefect_harness, tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="train.csv: no training results"):
        fit_flow(root=str(ROOT), preset="ci", workdir=str(tmp_path))
    client = mlflow.MlflowClient(tracking_uri(tmp_path))
    exp = client.get_experiment_by_name("scalelab")
    runs = client.search_runs([exp.experiment_id], f"tags.`scalelab.workdir` = '{tmp_path}'")
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FAILED"
    assert "FileNotFoundError" in run.data.tags["error"] and "train.csv" in run.data.tags["error"]


def test_bad_params_fail_before_any_run_starts(prefect_harness, tmp_path: Path):
    import shutil

    shutil.copytree(ROOT / "params", tmp_path / "params")
    path = tmp_path / "params" / "fit.yaml"
    path.write_text(path.read_text().replace("fit:\n", "fit:\n  n_boostrap: 3\n", 1))
    with pytest.raises(ValueError, match=r"fit\.yaml:\d+: fit\.n_boostrap: unknown key"):
        fit_flow(root=str(tmp_path), preset="ci", workdir=str(tmp_path / "work"))
    client = mlflow.MlflowClient(tracking_uri(tmp_path / "work"))
    exp = client.get_experiment_by_name("scalelab")
    if exp is not None:
        assert not client.search_runs([exp.experiment_id], f"tags.`scalelab.workdir` = '{tmp_path / 'work'}'")
