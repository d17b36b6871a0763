from __future__ import annotations

from pathlib import Path

import mlflow
import pytest

from tasks.common.tracking import tracked_run


@pytest.fixture()
def uri(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def test_child_run_links_to_parent_and_finishes(uri: str):
    with tracked_run("pipeline", uri=uri, experiment="t", params={"preset": "ci"}) as parent:
        with tracked_run("train", uri=uri, experiment="t", parent=parent.ref(), params={"variant": "raw", "cfg": {"lr": 0.1}}) as child:
            child.log_metrics({"val_loss": 3.5, "ppl": None, "bad": float("nan")}, step=2)
    client = mlflow.MlflowClient(uri)
    run = client.get_run(child.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["mlflow.parentRunId"] == parent.run_id
    assert run.data.params == {"variant": "raw", "cfg.lr": "0.1"}
    # Missing values stay missing rather than becoming 0.
    assert run.data.metrics == {"val_loss": 3.5}
    assert client.get_run(parent.run_id).info.status == "FINISHED"


def test_failure_marks_run_failed_with_error(uri: str):
    with pytest.raises(ZeroDivisionError):
        with tracked_run("boom", uri=uri, experiment="t") as run:
            1 / 0
    info = mlflow.MlflowClient(uri).get_run(run.run_id)
    assert info.info.status == "FAILED"
    assert "ZeroDivisionError" in info.data.tags["error"]


def test_dvc_temp_experiments_log_to_the_main_tree(monkeypatch, tmp_path: Path):
    from tasks.common.tracking import tracking_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    copy = tmp_path / "repo" / ".dvc" / "tmp" / "exps" / "run" / "abc123"
    assert tracking_uri(copy) == f"sqlite:///{tmp_path / 'repo' / 'mlflow.db'}"
    assert tracking_uri(tmp_path / "repo") == f"sqlite:///{tmp_path / 'repo' / 'mlflow.db'}"
