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
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.common.config import flatten

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


def _client(uri: str):
    import mlflow

    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    return mlflow.MlflowClient(tracking_uri=uri)


def _experiment_id(client, name: str) -> str:
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        return client.create_experiment(name)
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

    def ref(self) -> RunRef:
        return RunRef(uri=self.uri, experiment=self.experiment, run_id=self.run_id)

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        flat = flatten(params)
        if not flat:
            return
        items = [Param(k, _param_value(v)) for k, v in flat.items() if v is not None]
        client = _client(self.uri)
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
        client = _client(self.uri)
        for i in range(0, len(items), 500):
            client.log_batch(self.run_id, metrics=items[i : i + 500])

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        client = _client(self.uri)
        for k, v in tags.items():
            client.set_tag(self.run_id, k, _param_value(v))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        path = Path(path)
        if path.exists():
            _client(self.uri).log_artifact(self.run_id, str(path), artifact_path)


@dataclass(frozen=True)
class RunRef:
    """A picklable pointer to a run (for threads, subprocesses and Ray workers)."""

    uri: str
    experiment: str
    run_id: str


@contextlib.contextmanager
def tracked_run(
    name: str,
    *,
    uri: str,
    experiment: str = DEFAULT_EXPERIMENT,
    parent: RunRef | TrackedRun | None = None,
    params: Mapping[str, Any] | None = None,
    tags: Mapping[str, Any] | None = None,
) -> Iterator[TrackedRun]:
    """Open an MLflow run (a child of ``parent`` when given) that always ends.

    FINISHED on success; FAILED on any exception (KeyboardInterrupt included), with
    the error message and traceback tagged, and the exception re-raised. No run is
    left RUNNING by a failure inside the block.
    """
    client = _client(uri)
    exp_id = _experiment_id(client, experiment)
    all_tags = {"mlflow.runName": name}
    if parent is not None:
        all_tags["mlflow.parentRunId"] = parent.run_id
    all_tags.update({k: _param_value(v) for k, v in (tags or {}).items()})
    run = client.create_run(exp_id, run_name=name, tags=all_tags)
    handle = TrackedRun(uri=uri, experiment=experiment, run_id=run.info.run_id)
    try:
        if params:
            handle.log_params(params)
        yield handle
    except BaseException as exc:
        with contextlib.suppress(Exception):
            client.set_tag(handle.run_id, "error", _param_value(f"{type(exc).__name__}: {exc}"))
            client.set_tag(handle.run_id, "error.traceback", _param_value(traceback.format_exc()))
        client.set_terminated(handle.run_id, status="FAILED")
        raise
    else:
        client.set_terminated(handle.run_id, status="FINISHED")
