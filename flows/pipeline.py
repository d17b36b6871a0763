"""The whole study: prepare -> curate -> train -> compress -> prune -> sparse_eval -> evaluate -> fit.

Run: ``scalelab run all --preset ci`` (or ``dvc repro``, which runs the same stages one by one).
One MLflow parent run per pipeline run; each stage is a child, each model a grandchild.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from flows.compress import compress_flow
from flows.curate import curate_flow
from flows.evaluate import evaluate_flow
from flows.fit import fit_flow
from flows.plan import print_plan, training_plan
from flows.prepare import prepare_flow
from flows.select import select_flow
from flows.prune import prune_flow
from flows.sparse_eval import sparse_eval_flow
from flows.stage import stage_context
from flows.train import train_flow
from flows.runtime import claim_workdir
from flows.report import summary_markdown, write_summary
from flows.report_metrics import HEADLINE_STAGES, write_stage_metrics
from tasks.common.tracking import REPLACES, tracked_run

STAGE_FLOWS = {
    "prepare": prepare_flow,
    "curate": curate_flow,
    "train": train_flow,
    "compress": compress_flow,
    "prune": prune_flow,
    "sparse_eval": sparse_eval_flow,
    "evaluate": evaluate_flow,
    "fit": fit_flow,
    "select": select_flow,
}


@flow(name="pipeline", log_prints=True)
def pipeline_flow(
    root: str = ".",
    preset: str | None = None,
    workdir: str | None = None,
    runner: str | None = None,
    stages: list[str] | None = None,
) -> dict:
    ctx = stage_context(root, preset, workdir, runner)
    chosen = stages or list(STAGE_FLOWS)
    unknown = [s for s in chosen if s not in STAGE_FLOWS]
    if unknown:
        raise ValueError(f"unknown stage {unknown[0]!r}; stages: {', '.join(STAGE_FLOWS)}")
    results = {}
    tags = {"scalelab.stage": "pipeline", "scalelab.preset": ctx.preset}
    # One writer per workdir for the whole pipeline; a killed predecessor's runs end as KILLED first.
    with claim_workdir(ctx) as claim, tracked_run(
        f"pipeline-{ctx.preset}",
        uri=ctx.tracking_uri,
        experiment=ctx.experiment,
        parent=ctx.parent,
        params={"preset": ctx.preset, "runner": ctx.pipeline.runner, "stages": ",".join(chosen)},
        tags=tags | ({REPLACES: ",".join(r)} if (r := claim.take_replaced()) else {}),
        workdir=ctx.workdir,
    ) as run:
        for name in chosen:
            if name == "train":  # after curation, before any training: tokens, ladders, FLOPs, time (flows/plan.py)
                print_plan(training_plan(ctx))
            results[name] = STAGE_FLOWS[name](
                root=str(ctx.root), preset=ctx.preset, workdir=str(ctx.workdir),
                runner=ctx.pipeline.runner, parent_run_id=run.run_id,
            )
            if name in HEADLINE_STAGES:
                write_stage_metrics(name, ctx.layout.reports)
        summary_path = publish_summary(ctx.layout.reports)
        run.log_artifact(summary_path, "reports")
    return {"parent_run_id": run.run_id, "stages": chosen, "summary": str(summary_path)}


def publish_summary(reports: Path) -> Path:
    """Write reports/summary.md (what the run found, :mod:`flows.report`) and publish it as
    the pipeline run's Prefect markdown artifact (plots named, not embedded: the UI cannot reach them)."""
    summary, path = write_summary(reports)
    create_markdown_artifact(key="pipeline-summary", markdown=summary_markdown(summary, images=False),
                             description=f"What the pipeline found ({path})")
    return path
