"""The frame every stage flow runs in: resolve the context, open the stage's MLflow run.

A stage flow body is::

    ctx = stage_context(root, preset, workdir, runner, parent_run_id)
    cfg = ctx.config(CurationConfig, "curation")
    with stage_run(ctx, "curate", cfg) as run:
        ...  # read inputs, call tasks, write outputs, run.log_metrics(...)
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import polars as pl

from flows.runtime import Context, claim_workdir, make_context
from tasks.common.config import to_dict
from tasks.common.io import write_csv
from tasks.common.provenance import source_tags
from tasks.common.tracking import REPLACES, TrackedRun, tracked_run

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
        from tasks.common.tracking import RunRef

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
