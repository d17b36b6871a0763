"""MLflow conventions: one parent run per pipeline run, a child per stage and per model.

Runs are driven through :class:`mlflow.MlflowClient` with explicit run ids, not
MLflow's process-global "active run", so a child can be opened from a thread, a
subprocess or a Ray worker by passing its parent's id.

Names kept consistent across stages so the MLflow UI compares runs side by side:

* params: ``stage``, ``variant``, ``n_params`` (non-embedding N), ``tokens`` (D),
  ``method``, ``bits``, ``group_size``, ``sparsity``, ``preset``, plus the step's
  resolved config flattened under its own prefix;
* metrics: ``val_loss``, ``ppl``, ``tokens_per_s``, ``flops``, ``bytes_on_disk``,
  ``docs_in``, ``docs_kept``, ``dropped.<reason>``...

A missing value is left out, never logged as 0.

Ownership (crash safety): every run records who owns it, as tags ``scalelab.owner.host``,
``scalelab.owner.pid``, ``scalelab.owner.start`` (the process's start time, so a reused pid is not
mistaken for the owner) and ``scalelab.heartbeat`` (unix seconds, refreshed every
``$SCALELAB_HEARTBEAT_S`` seconds, default 30, while the run is open). A process killed with
SIGKILL cannot end its own runs; :func:`close_orphaned_runs`, called when the next command starts
on the workdir, ends them as KILLED with the reason tagged.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import threading
import time
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.common.config import flatten
from tasks.common.provenance import SOURCE_TAGS, source_tags

DEFAULT_EXPERIMENT = "scalelab"


def tracking_uri(root: str | Path) -> str:
    """``$MLFLOW_TRACKING_URI`` if set, else ``sqlite:///<root>/mlflow.db`` as an absolute path.

    Absolute, because ``dvc exp run --temp`` runs stages in a copy of the repo and a
    relative store would be lost with the copy.
    """
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return f"sqlite:///{main_tree(Path(root).resolve()) / 'mlflow.db'}"


def main_tree(path: Path) -> Path:
    """The repository a ``dvc exp run --temp``/``--queue`` copy was made from, else ``path`` itself.

    DVC runs such experiments in ``<repo>/.dvc/tmp/exps/...``; runs logged there would vanish
    with the copy, so they go to the main working tree's store.
    """
    parts = path.parts
    for i in range(len(parts) - 2):
        if parts[i : i + 3] == (".dvc", "tmp", "exps"):
            return Path(*parts[:i])
    return path


def mlflow_client(uri: str):
    """An ``MlflowClient`` on the store at ``uri`` (synchronous logging)."""
    import mlflow

    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    return mlflow.MlflowClient(tracking_uri=uri)


def artifact_root(uri: str) -> str | None:
    """Where a new experiment of a sqlite store keeps its artifacts: ``mlartifacts/`` beside the
    database (MLflow's default, ``./mlruns`` under the current folder, would put a workdir's
    artifacts wherever the command happened to run). ``None`` (MLflow's choice) for other stores."""
    if not uri.startswith("sqlite:///"):
        return None
    return (Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts").resolve().as_uri()


# The MLflow 3 UI opens an experiment without this tag in its GenAI layout (models listed as
# "Agent versions", no training-run views); scalelab's runs train models.
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}


def experiment_id(client, name: str, uri: str | None = None) -> str:
    """The id of experiment ``name``, created (with :data:`EXPERIMENT_KIND`) when it does not exist."""
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        if exp.tags.get("mlflow.experimentKind") is None:  # an older store: set once, never override a user's choice
            client.set_experiment_tag(exp.experiment_id, *next(iter(EXPERIMENT_KIND.items())))
        return exp.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_root(uri) if uri else None,
                                        tags=EXPERIMENT_KIND)
    except Exception:  # created concurrently by another process
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def _param_value(v: Any) -> str:
    s = str(v)
    return s if len(s) <= 6000 else s[:5997] + "..."


@dataclass
class TrackedRun:
    """A handle on one MLflow run; pass ``ref()`` to workers so they can open children."""

    uri: str
    experiment: str
    run_id: str
    workdir: str | None = None

    def ref(self) -> RunRef:
        return RunRef(uri=self.uri, experiment=self.experiment, run_id=self.run_id, workdir=self.workdir)

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        flat = flatten(params)
        if not flat:
            return
        items = [Param(k, _param_value(v)) for k, v in flat.items() if v is not None]
        client = mlflow_client(self.uri)
        for i in range(0, len(items), 100):
            client.log_batch(self.run_id, params=items[i : i + 100])

    def log_metrics(self, metrics: Mapping[str, float | int | None], step: int | None = None) -> None:
        """Log finite numeric metrics; ``None`` and NaN stay missing rather than becoming 0."""
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        items = [
            Metric(k, float(v), ts, step or 0)
            for k, v in flatten(metrics).items()
            if v is not None and isinstance(v, (int, float)) and math.isfinite(float(v))
        ]
        client = mlflow_client(self.uri)
        for i in range(0, len(items), 500):
            client.log_batch(self.run_id, metrics=items[i : i + 500])

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        client = mlflow_client(self.uri)
        for k, v in tags.items():
            client.set_tag(self.run_id, k, _param_value(v))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        path = Path(path)
        if path.exists():
            mlflow_client(self.uri).log_artifact(self.run_id, str(path), artifact_path)


@dataclass(frozen=True)
class RunRef:
    """A picklable pointer to a run (for threads, subprocesses and Ray workers)."""

    uri: str
    experiment: str
    run_id: str
    workdir: str | None = None


# ---------------------------------------------------------------------------------------------
# Ownership: who opened a run, and whether they are still alive

OWNER_HOST, OWNER_PID, OWNER_START, HEARTBEAT = (
    "scalelab.owner.host", "scalelab.owner.pid", "scalelab.owner.start", "scalelab.heartbeat")
WORKDIR_TAG = "scalelab.workdir"
KILLED_REASON, KILLED_AT, REPLACES = "scalelab.killed.reason", "scalelab.killed.at", "scalelab.replaces"
DEFAULT_ORPHAN_TIMEOUT_S = 900.0


def process_start_time(pid: int) -> str | None:
    """An identifier of when ``pid`` started (``/proc/<pid>/stat`` field 22, clock ticks since boot),
    or None when the process does not exist or the platform has no ``/proc``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces: split after its last ')'
    return stat.rsplit(")", 1)[1].split()[19]


def pid_alive(pid: int, start: str | None = None) -> bool:
    """Whether process ``pid`` runs on this host (and, when ``start`` is given, is the same process)."""
    if pid <= 0:
        return False
    now_start = process_start_time(pid)
    if now_start is not None:
        return start is None or start == now_start
    if Path("/proc/self/stat").exists():  # /proc exists but not this pid: it is gone
        return False
    try:  # no /proc (macOS): signal 0 checks existence only
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def owner_tags() -> dict[str, str]:
    """The tags naming this process as a run's (or a lock's) owner."""
    pid = os.getpid()
    return {OWNER_HOST: socket.gethostname(), OWNER_PID: str(pid), OWNER_START: process_start_time(pid) or "",
            HEARTBEAT: str(int(time.time()))}


def owner_gone(tags: Mapping[str, str], *, timeout_s: float, now: float | None = None) -> str | None:
    """Why the owner recorded in ``tags`` is gone (a sentence), or None while it may be alive.

    On this host the pid is checked (and its start time, against pid reuse); a run opened on another
    host (a Ray worker, a second machine on a shared store) is gone when its heartbeat is older than
    ``timeout_s``.
    """
    now = time.time() if now is None else now
    host, pid = tags.get(OWNER_HOST), tags.get(OWNER_PID)
    if host == socket.gethostname() and pid and pid.isdigit():
        if not pid_alive(int(pid), tags.get(OWNER_START) or None):
            return f"owner process {pid} on {host} is gone"
        return None
    beat = tags.get(HEARTBEAT)
    if beat is not None:
        age = now - float(beat)
        return f"no heartbeat from {host}:{pid} for {age:.0f} s (timeout {timeout_s:.0f} s)" if age > timeout_s else None
    return None


class _Heartbeat:
    """One daemon thread per process refreshing ``scalelab.heartbeat`` on every open run."""

    def __init__(self) -> None:
        self._runs: dict[str, str] = {}  # run id -> tracking uri
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, uri: str, run_id: str) -> None:
        with self._lock:
            self._runs[run_id] = uri
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="scalelab-heartbeat", daemon=True)
                self._thread.start()

    def remove(self, run_id: str) -> None:
        with self._lock:
            self._runs.pop(run_id, None)

    def _loop(self) -> None:
        interval = float(os.environ.get("SCALELAB_HEARTBEAT_S", "30"))
        while True:
            time.sleep(interval)
            with self._lock:
                runs = dict(self._runs)
            beat = str(int(time.time()))
            for run_id, uri in runs.items():
                with contextlib.suppress(Exception):  # a busy store misses one beat, not the run
                    mlflow_client(uri).set_tag(run_id, HEARTBEAT, beat)


_HEARTBEAT = _Heartbeat()


def close_orphaned_runs(
    uri: str,
    experiment: str = DEFAULT_EXPERIMENT,
    *,
    workdir: str | Path | None = None,
    timeout_s: float = DEFAULT_ORPHAN_TIMEOUT_S,
) -> list[str]:
    """End the RUNNING runs of ``experiment`` whose owner is gone, as KILLED; return their ids.

    A run whose owner process is dead on this host is closed whatever its workdir (it can never end
    otherwise); a run from another host is closed when its heartbeat is older than ``timeout_s`` and
    it belongs to ``workdir``. Each closed run is tagged with the reason and when it was found.
    """
    client = mlflow_client(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    from mlflow.entities import ViewType

    now = time.time()
    closed = []
    runs = client.search_runs([exp.experiment_id], "attributes.status = 'RUNNING'", run_view_type=ViewType.ACTIVE_ONLY,
                              max_results=50000)
    for run in runs:
        tags = run.data.tags
        if OWNER_PID not in tags:
            continue  # not opened by scalelab: not ours to judge
        if tags.get(OWNER_HOST) != socket.gethostname() and (
                workdir is None or tags.get(WORKDIR_TAG) != str(workdir)):
            continue
        reason = owner_gone(tags, timeout_s=timeout_s, now=now)
        if reason is None:
            continue
        with contextlib.suppress(Exception):
            client.set_tag(run.info.run_id, KILLED_REASON, reason)
            client.set_tag(run.info.run_id, KILLED_AT, time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(now)))
        client.set_terminated(run.info.run_id, status="KILLED")
        closed.append(run.info.run_id)
    return closed


@contextlib.contextmanager
def tracked_run(
    name: str,
    *,
    uri: str,
    experiment: str = DEFAULT_EXPERIMENT,
    parent: RunRef | TrackedRun | None = None,
    params: Mapping[str, Any] | None = None,
    tags: Mapping[str, Any] | None = None,
    workdir: str | Path | None = None,
    system_metrics: bool = False,
) -> Iterator[TrackedRun]:
    """Open an MLflow run (a child of ``parent`` when given) that always ends.

    FINISHED on success; FAILED on any exception (KeyboardInterrupt included), with
    the error message and traceback tagged, and the exception re-raised. No run is
    left RUNNING by a failure inside the block; one left by a killed process is closed
    by :func:`close_orphaned_runs` (the run carries its owner and a heartbeat).
    ``workdir`` (default: the parent's) is tagged as ``scalelab.workdir``.

    Every run is tagged with the code's git commit and dirty flag
    (:func:`tasks.common.provenance.source_tags`); a child takes its parent's params hash unless
    ``tags`` gives one. ``system_metrics``: sample CPU, memory, disk and network into
    ``system/*`` metrics every ``$SCALELAB_SYSTEM_METRICS_S`` seconds (default 10) while the run
    is open, when psutil is installed (for long runs: a stage, not a model).
    """
    client = mlflow_client(uri)
    exp_id = experiment_id(client, experiment, uri)
    all_tags = {"mlflow.runName": name, **owner_tags(), **source_tags()}
    if parent is not None:
        all_tags["mlflow.parentRunId"] = parent.run_id
        if not any(k in (tags or {}) for k in SOURCE_TAGS[2:]):
            with contextlib.suppress(Exception):  # a parent from another store: no params hash to inherit
                inherited = client.get_run(parent.run_id).data.tags
                all_tags.update({k: inherited[k] for k in SOURCE_TAGS[2:] if k in inherited})
    workdir = str(workdir) if workdir is not None else (parent.workdir if parent is not None else None)
    if workdir is not None:
        all_tags[WORKDIR_TAG] = workdir
    all_tags.update({k: _param_value(v) for k, v in (tags or {}).items()})
    run = client.create_run(exp_id, run_name=name, tags=all_tags)
    handle = TrackedRun(uri=uri, experiment=experiment, run_id=run.info.run_id, workdir=workdir)
    _HEARTBEAT.add(uri, handle.run_id)
    monitor = _system_monitor(uri, handle.run_id) if system_metrics else None
    try:
        if params:
            handle.log_params(params)
        yield handle
    except BaseException as exc:
        _stop_monitor(monitor)
        with contextlib.suppress(Exception):
            client.set_tag(handle.run_id, "error", _param_value(f"{type(exc).__name__}: {exc}"))
            client.set_tag(handle.run_id, "error.traceback", _param_value(traceback.format_exc()))
        _HEARTBEAT.remove(handle.run_id)
        client.set_terminated(handle.run_id, status="FAILED")
        raise
    else:
        _stop_monitor(monitor)
        _HEARTBEAT.remove(handle.run_id)
        client.set_terminated(handle.run_id, status="FINISHED")


def failed_run(
    name: str,
    error: BaseException,
    *,
    uri: str,
    experiment: str = DEFAULT_EXPERIMENT,
    parent: RunRef | TrackedRun | None = None,
    params: Mapping[str, Any] | None = None,
    tags: Mapping[str, Any] | None = None,
    traceback_text: str | None = None,
) -> str:
    """Record ``error`` as a FAILED run of its own (a unit of work that failed before or outside any
    run it would have opened): tagged ``error`` (type and message) and ``error.traceback``, like a
    run :func:`tracked_run` ends as FAILED. Returns its id."""
    client = mlflow_client(uri)
    exp_id = experiment_id(client, experiment, uri)
    workdir = parent.workdir if parent is not None else None
    all_tags = {"mlflow.runName": name, **owner_tags(), **source_tags(),
                "error": _param_value(f"{type(error).__name__}: {error}"),
                "error.traceback": _param_value(traceback_text or "".join(traceback.format_exception(error)))}
    if parent is not None:
        all_tags["mlflow.parentRunId"] = parent.run_id
    if workdir is not None:
        all_tags[WORKDIR_TAG] = workdir
    all_tags.update({k: _param_value(v) for k, v in (tags or {}).items()})
    run = client.create_run(exp_id, run_name=name, tags=all_tags)
    try:
        if params:
            TrackedRun(uri=uri, experiment=experiment, run_id=run.info.run_id).log_params(params)
    finally:
        client.set_terminated(run.info.run_id, status="FAILED")
    return run.info.run_id


def _system_monitor(uri: str, run_id: str):
    """MLflow's system-metrics sampler on ``run_id`` (a daemon thread), or None without psutil."""
    import importlib.util
    import logging

    if importlib.util.find_spec("psutil") is None:
        logging.getLogger("scalelab").info("no system metrics for run %s: psutil is not installed (pip install psutil)",
                                           run_id)
        return None
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # one INFO line per start/stop otherwise
    monitor = SystemMetricsMonitor(run_id, sampling_interval=float(os.environ.get("SCALELAB_SYSTEM_METRICS_S", "10")),
                                   tracking_uri=uri)
    monitor.start()
    return monitor


def _stop_monitor(monitor) -> None:
    if monitor is not None:
        with contextlib.suppress(Exception):  # the run's end matters more than its last sample
            monitor.finish()
