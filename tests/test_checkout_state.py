"""The session's guard on the checkout's own state (tests/checkout_state.py, used by tests/conftest.py),
and the settings that keep Prefect and MLflow off that state."""

from __future__ import annotations

import os
from pathlib import Path

from tests.checkout_state import state_changes, state_snapshot

ROOT = Path(__file__).resolve().parents[1]


def test_added_changed_and_removed_state_files_are_named(tmp_path: Path):
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "train.csv").write_text("a\n1\n")
    (tmp_path / "mlflow.db").write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("not project state")
    before = state_snapshot(tmp_path)
    assert set(before) == {"reports/train.csv", "mlflow.db"}
    assert state_changes(before, state_snapshot(tmp_path)) == []

    (tmp_path / "mlflow.db").write_bytes(b"xy")
    (tmp_path / "reports" / "train.csv").unlink()
    (tmp_path / ".prefect").mkdir()
    (tmp_path / ".prefect" / "prefect.db").write_bytes(b"")
    (tmp_path / "data" / "prepared").mkdir(parents=True)
    (tmp_path / "data" / "prepared" / "val.parquet").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("edited: still not project state")
    assert state_changes(before, state_snapshot(tmp_path)) == [
        "added    .prefect/prefect.db", "added    data/prepared/val.parquet", "changed  mlflow.db",
        "removed  reports/train.csv"]


def test_prefect_and_mlflow_point_outside_the_checkout():
    """The Makefile exports PREFECT_HOME=<checkout>/.prefect; the session replaces it before Prefect is
    imported, so flow runs (and the ones subprocesses start) land in a temporary folder."""
    from prefect.settings import get_current_settings

    home = Path(get_current_settings().home).resolve()
    assert Path(os.environ["PREFECT_HOME"]).resolve() == home
    assert not home.is_relative_to(ROOT.resolve()), home
    assert "PREFECT_API_URL" not in os.environ
    store = Path(os.environ["MLFLOW_TRACKING_URI"].removeprefix("sqlite:///")).resolve()
    assert not store.is_relative_to(ROOT.resolve()), store


def test_every_file_using_the_ci_pipeline_is_scheduled_with_it(request):
    """`make test` runs the ci pipeline once only if every test using ``ci_run`` is in one xdist unit
    (tests/scheduling.py): a new user of the fixture must be added to CI_RUN_FILES."""
    from tests.scheduling import CI_RUN_FILES, scope

    users = {item.nodeid.split("::", 1)[0] for item in request.session.items if "ci_run" in item.fixturenames}
    assert users <= set(CI_RUN_FILES), sorted(users - set(CI_RUN_FILES))
    assert {scope(f + "::t") for f in CI_RUN_FILES} == {"ci_run"}
    assert scope("tests/flows/test_cli.py::test_x") == "tests/flows/test_cli.py"
