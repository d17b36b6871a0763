"""Scheduled deployments served from one process: ``scalelab serve`` (Ctrl-C stops).

The same schedules as infra/prefect.yaml, for a single machine without work pools.
"""

from __future__ import annotations

from pathlib import Path

from flows.fit import fit_flow
from flows.pipeline import pipeline_flow


def deployments(root: str | Path):
    root = str(Path(root).resolve())
    return [
        pipeline_flow.to_deployment(
            name="nightly-ci", cron="0 2 * * *",
            parameters={"root": root, "preset": "ci", "workdir": f"{root}/runs/nightly-ci"},
        ),
        pipeline_flow.to_deployment(
            name="weekly-demo", cron="0 3 * * 0",
            parameters={"root": root, "preset": "demo", "workdir": f"{root}/runs/weekly-demo"},
        ),
        fit_flow.to_deployment(name="refit", cron="30 * * * *", parameters={"root": root, "preset": "demo"}),
    ]


def serve_all(root: str | Path) -> None:
    from prefect import serve

    serve(*deployments(root))
