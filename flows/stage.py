"""The frame every stage flow runs in: resolve the context, open the stage's MLflow run.

A stage flow body is::

    ctx = stage_context(root, preset, workdir, runner, parent_run_id)
    cfg = ctx.config(CurationConfig, "curation")
    with stage_run(ctx, "curate", cfg) as run:
        ...  # read inputs, call tasks, write outputs, run.log_metrics(...)

A stage whose work splits into units (one model, one variant, one setting) runs them through
:class:`StageUnits`, so one unit's failure never sinks the others::

    units = StageUnits(ctx, run, "compress")
    results = units.map(compress_job, jobs, names)   # None where a unit failed
    units.close()                                     # reports/failures/compress.csv; raises if all failed
"""

from __future__ import annotations

import contextlib
import logging
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from flows.runtime import Context, claim_workdir, make_context, map_outcomes
from tasks.common.config import ConfigError, to_dict
from tasks.common.io import write_csv, write_text
from tasks.common.provenance import source_tags
from tasks.common.tracking import REPLACES, RunRef, TrackedRun, failed_run, tracked_run

log = logging.getLogger("scalelab")


def stage_context(
    root: str = ".",
    preset: str | None = None,
    workdir: str | None = None,
    runner: str | None = None,
    parent_run_id: str | None = None,
) -> Context:
    ctx = make_context(root, preset=preset, workdir=workdir, runner=runner)
    if parent_run_id:
        ctx = ctx.with_parent(RunRef(uri=ctx.tracking_uri, experiment=ctx.experiment, run_id=parent_run_id))
    return ctx


@contextlib.contextmanager
def stage_run(ctx: Context, stage: str, cfg: Any | None = None, *, run_name: str | None = None,
              **params: Any) -> Iterator[TrackedRun]:
    """The stage's MLflow run (a child of the pipeline run when there is one), with its resolved config.

    The stage holds the workdir's writer lock while it runs (:func:`flows.runtime.claim_workdir`):
    a second writer is refused, and what a killed predecessor left is cleaned up first.

    A per-item child (one curated variant, one fitted law) passes ``run_name`` (``curate:raw``) and
    keeps ``stage``, so ``params.stage = 'curate'`` finds the stage's runs at every level.
    """
    logged = {"stage": stage, "preset": ctx.preset, **params}
    if cfg is not None:
        logged[stage] = to_dict(cfg)
    tags = {"scalelab.stage": stage, "scalelab.preset": ctx.preset, **source_tags(ctx.root, stage)}
    with claim_workdir(ctx) as claim:
        if replaced := claim.take_replaced():
            tags[REPLACES] = ",".join(replaced)
        # CPU/memory samples on the stage's own run (minutes long), not on each per-item child
        with tracked_run(run_name or stage, uri=ctx.tracking_uri, experiment=ctx.experiment, parent=ctx.parent,
                         params=logged, tags=tags, workdir=ctx.workdir, system_metrics=run_name is None) as run:
            yield run


def write_table(ctx: Context, name: str, rows: list[dict[str, Any]] | pl.DataFrame,
                run: TrackedRun | None = None) -> pl.DataFrame:
    """Write ``reports/<name>.csv`` (for `dvc plots`/`dvc metrics`) and attach it to the run.

    ``rows`` may be a frame, so a table with no rows still has its columns (a header-only CSV)."""
    if isinstance(rows, pl.DataFrame):
        frame = rows
    else:
        frame = pl.DataFrame(rows, infer_schema_length=None) if rows else pl.DataFrame()
    path = write_csv(ctx.layout.reports / f"{name}.csv", frame)
    if run is not None:
        run.log_artifact(path, "reports")
    return frame


# ---------------------------------------------------------------------------------------------
# Per-unit failures: one model, variant or setting failing never sinks the others

# Every row of a stage table built from units says whether its unit finished (``ok``) or not
# (``failed``, with ``error``); a failed unit's rows keep the columns that name it, metrics empty.
STATUS, ERROR, OK, FAILED = "status", "error", "ok", "failed"
FAILURE_COLUMNS = ("stage", "unit", "error_type", "error", "mlflow_run_id")
FAILURES_DIR = "failures"


@dataclass(frozen=True)
class UnitFailure:
    """One unit of a stage that raised: which, the error, and the FAILED MLflow run recording it."""

    stage: str
    unit: str
    error_type: str
    error: str
    mlflow_run_id: str | None
    traceback: str

    def row(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in FAILURE_COLUMNS}


class StageFailed(RuntimeError):
    """Every unit of a stage failed: no isolation to speak of, most likely a bug the units share."""


def is_unit_error(exc: BaseException) -> bool:
    """Whether ``exc``, raised inside one unit's job, is that unit's own failure. A config error
    (:class:`~tasks.common.config.ConfigError`: a bad params key caught late) is everyone's, and an
    interrupt (``KeyboardInterrupt``, ``SystemExit``) is the user's: those stop the stage."""
    return isinstance(exc, Exception) and not isinstance(exc, ConfigError)


class StageUnits:
    """Run a stage's units so each one that can finish does, and record each that cannot.

    A unit's failure is an exception raised inside its job; it is logged with its traceback,
    recorded as a FAILED MLflow run ``<stage>:<unit>`` under the stage run (tags ``error``,
    ``error.traceback``, ``scalelab.unit``), and listed in ``reports/failures/<stage>.csv``
    (:data:`FAILURE_COLUMNS`; tracebacks in ``<stage>.log`` beside it). What the stage does before or
    after its units (reading inputs, writing tables) is shared code and is not isolated, nor is a
    config error. :meth:`close` raises :class:`StageFailed` when every unit failed.
    """

    def __init__(self, ctx: Context, run: TrackedRun, stage: str) -> None:
        self.ctx, self.run, self.stage = ctx, run, stage
        self.failures: list[UnitFailure] = []
        self.attempted = 0

    def map(self, task: Any, jobs: list[dict[str, Any]], names: list[str], *, gpu: bool = True) -> list[Any]:
        """``task`` once per job through the context's runner (:func:`flows.runtime.map_outcomes`);
        the results in order, ``None`` for each unit that failed. ``names[i]`` names job ``i``'s unit."""
        if len(names) != len(jobs):
            raise ValueError(f"{self.stage}: {len(jobs)} jobs but {len(names)} unit names")
        out = []
        for name, (result, error) in zip(names, map_outcomes(self.ctx.pipeline, task, jobs, gpu=gpu)):
            self.attempted += 1
            if error is not None:
                self._record(name, error)
            out.append(result)
        return out

    def call(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` as one unit in this process: its result, or ``None`` if it failed."""
        self.attempted += 1
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 — _record re-raises what is not the unit's own failure
            self._record(name, exc)
            return None

    def _record(self, name: str, exc: BaseException) -> None:
        if not is_unit_error(exc):
            raise exc
        text = "".join(traceback.format_exception(exc))
        log.error("%s: unit %s failed (%s: %s); the other units go on", self.stage, name, type(exc).__name__, exc)
        try:
            run_id = failed_run(f"{self.stage}:{name}", exc, uri=self.run.uri, experiment=self.run.experiment,
                                parent=self.run.ref(), traceback_text=text,
                                params={"stage": self.stage, "unit": name, "preset": self.ctx.preset},
                                tags={"scalelab.stage": self.stage, "scalelab.unit": name})
        except Exception as track_exc:  # noqa: BLE001 — the failure is still listed in reports/failures/
            log.warning("%s: could not record unit %s's failure in MLflow (%s)", self.stage, name, track_exc)
            run_id = None
        print(f"{self.stage}: FAILED {name}: {type(exc).__name__}: {exc}")
        self.failures.append(UnitFailure(stage=self.stage, unit=name, error_type=type(exc).__name__,
                                         error=str(exc), mlflow_run_id=run_id, traceback=text))

    def failed(self, name: str) -> UnitFailure | None:
        return next((f for f in self.failures if f.unit == name), None)

    def failed_rows(self, name: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``rows`` (the columns naming unit ``name``'s rows) marked failed with its error; [] if it did not fail."""
        f = self.failed(name)
        if f is None:
            return []
        return [r | {STATUS: FAILED, ERROR: f"{f.error_type}: {f.error}"} for r in rows]

    def close(self) -> list[UnitFailure]:
        """Write ``reports/failures/<stage>.csv`` (header only when nothing failed) and its log, tag
        the stage run with the count, and raise :class:`StageFailed` if every unit failed."""
        write_failures(self.ctx.layout.reports, self.stage, self.failures, self.run)
        self.run.log_metrics({"units": self.attempted, "units_failed": len(self.failures)})
        if self.failures:
            self.run.set_tags({"scalelab.failed_units": ", ".join(f.unit for f in self.failures)})
        if self.attempted and len(self.failures) == self.attempted:
            first = self.failures[0]
            raise StageFailed(f"{self.stage}: every unit failed ({self.attempted}); the first, {first.unit}: "
                              f"{first.error_type}: {first.error} (all in "
                              f"{failures_path(self.ctx.layout.reports, self.stage)})")
        return self.failures


def mark_ok(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` of units that finished, with ``status`` ok and no ``error``."""
    return [r | {STATUS: OK, ERROR: None} for r in rows]


def failures_path(reports: Path, stage: str) -> Path:
    return reports / FAILURES_DIR / f"{stage}.csv"


def write_failures(reports: Path, stage: str, failures: list[UnitFailure], run: TrackedRun | None = None) -> Path:
    """``reports/failures/<stage>.csv`` (always written, so a rerun that fails nothing clears the last
    run's list) and ``<stage>.log`` with each failure's traceback."""
    frame = (pl.DataFrame([f.row() for f in failures], infer_schema_length=None) if failures
             else pl.DataFrame(schema=dict.fromkeys(FAILURE_COLUMNS, pl.String)))
    path = write_csv(failures_path(reports, stage), frame)
    log_path = write_text(path.with_suffix(".log"), "".join(f"== {f.stage}:{f.unit}\n{f.traceback}\n" for f in failures))
    if run is not None and failures:
        run.log_artifact(path, "reports/failures")
        run.log_artifact(log_path, "reports/failures")
    return path


def read_failures(reports: Path) -> pl.DataFrame:
    """Every stage's ``reports/failures/<stage>.csv`` in one frame (:data:`FAILURE_COLUMNS`, all text),
    by stage name; empty when nothing failed or no stage wrote one."""
    frames = []
    for path in sorted((reports / FAILURES_DIR).glob("*.csv")):
        if path.stat().st_size == 0:
            continue
        frame = pl.read_csv(path, infer_schema_length=0)
        if frame.height:
            frames.append(frame.select(FAILURE_COLUMNS))
    return pl.concat(frames) if frames else pl.DataFrame(schema=dict.fromkeys(FAILURE_COLUMNS, pl.String))


def finished(frame: pl.DataFrame) -> pl.DataFrame:
    """The rows of a stage table whose unit finished (all rows of a table without ``status``)."""
    return frame.filter(pl.col(STATUS) != FAILED) if STATUS in frame.columns else frame
