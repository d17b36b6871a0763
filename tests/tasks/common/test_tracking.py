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


def test_experiments_open_in_the_uis_model_training_layout(uri: str):
    from tasks.common.tracking import experiment_id

    client = mlflow.MlflowClient(uri)
    kind = lambda name: client.get_experiment_by_name(name).tags.get("mlflow.experimentKind")  # noqa: E731
    with tracked_run("train", uri=uri, experiment="new"):
        pass
    assert kind("new") == "custom_model_development"
    client.create_experiment("older")  # a store written before the tag existed gets it on next use
    experiment_id(client, "older", uri)
    assert kind("older") == "custom_model_development"
    client.create_experiment("chosen", tags={"mlflow.experimentKind": "genai_development"})
    experiment_id(client, "chosen", uri)
    assert kind("chosen") == "genai_development"


def _orphan(client, uri: str, name: str, tags: dict) -> str:
    from tasks.common.tracking import experiment_id

    return client.create_run(experiment_id(client, "t"), run_name=name, tags=tags).info.run_id


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_runs_record_their_owner_and_orphans_are_closed_as_killed(uri: str, tmp_path: Path):
    import os
    import socket
    import time

    from tasks.common import tracking as tr

    client = mlflow.MlflowClient(uri)
    with tracked_run("live", uri=uri, experiment="t", workdir=tmp_path) as live:
        tags = client.get_run(live.run_id).data.tags
        assert tags[tr.OWNER_PID] == str(os.getpid()) and tags[tr.OWNER_HOST] == socket.gethostname()
        assert tags[tr.WORKDIR_TAG] == str(tmp_path) and float(tags[tr.HEARTBEAT]) <= time.time()
        here, stale = socket.gethostname(), f"{time.time() - 3600:.0f}"
        dead = _orphan(client, uri, "dead", {tr.OWNER_HOST: here, tr.OWNER_PID: str(_dead_pid())})
        # the same pid, started at another time: a reused pid is not the owner
        reused = _orphan(client, uri, "reused", {tr.OWNER_HOST: here, tr.OWNER_PID: str(os.getpid()),
                                                  tr.OWNER_START: "1"})
        remote_stale = _orphan(client, uri, "remote-stale", {tr.OWNER_HOST: "worker-7", tr.OWNER_PID: "12",
                                                              tr.HEARTBEAT: stale, tr.WORKDIR_TAG: str(tmp_path)})
        remote_fresh = _orphan(client, uri, "remote-fresh", {tr.OWNER_HOST: "worker-7", tr.OWNER_PID: "12",
                                                              tr.HEARTBEAT: f"{time.time():.0f}",
                                                              tr.WORKDIR_TAG: str(tmp_path)})
        other_workdir = _orphan(client, uri, "remote-elsewhere", {tr.OWNER_HOST: "worker-7", tr.OWNER_PID: "12",
                                                                   tr.HEARTBEAT: stale, tr.WORKDIR_TAG: "/elsewhere"})
        foreign = _orphan(client, uri, "not-scalelab", {})
        closed = tr.close_orphaned_runs(uri, "t", workdir=tmp_path, timeout_s=600)
        assert sorted(closed) == sorted([dead, reused, remote_stale])
        for run_id in closed:
            run = client.get_run(run_id)
            assert run.info.status == "KILLED" and run.data.tags[tr.KILLED_AT]
        assert "is gone" in client.get_run(dead).data.tags[tr.KILLED_REASON]
        assert "no heartbeat from worker-7:12" in client.get_run(remote_stale).data.tags[tr.KILLED_REASON]
        for run_id in (live.run_id, remote_fresh, other_workdir, foreign):
            assert client.get_run(run_id).info.status == "RUNNING"
    assert client.get_run(live.run_id).info.status == "FINISHED"


def test_heartbeat_is_refreshed_while_a_run_is_open(uri: str, monkeypatch):
    import time

    from tasks.common import tracking as tr

    monkeypatch.setenv("SCALELAB_HEARTBEAT_S", "0.2")
    monkeypatch.setattr(tr, "_HEARTBEAT", tr._Heartbeat())
    client = mlflow.MlflowClient(uri)
    with tracked_run("long", uri=uri, experiment="t") as run:
        first = float(client.get_run(run.run_id).data.tags[tr.HEARTBEAT])
        deadline = time.time() + 10
        while float(client.get_run(run.run_id).data.tags[tr.HEARTBEAT]) <= first and time.time() < deadline:
            time.sleep(0.2)
        assert float(client.get_run(run.run_id).data.tags[tr.HEARTBEAT]) > first


def test_artifacts_go_beside_the_store_not_under_the_current_folder(tmp_path: Path, monkeypatch):
    """A workdir's artifacts belong to it: a run opened from another folder writes none there."""
    wd, elsewhere = tmp_path / "wd", tmp_path / "elsewhere"
    wd.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    report = tmp_path / "fits.json"
    report.write_text("{}")
    uri = f"sqlite:///{wd / 'mlflow.db'}"
    with tracked_run("fit", uri=uri, experiment="t") as run:
        run.log_artifact(report, "reports")
    assert list((wd / "mlartifacts").rglob("fits.json"))
    assert not list(elsewhere.iterdir())
