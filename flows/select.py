"""Stage select: DDCF fine-tuning data selection (setting (a), generated arithmetic).

Run: ``scalelab select [--preset ci]`` (or ``scalelab run select``, what dvc.yaml calls). Needs no
other stage's output. Writes ``reports/ddcf.csv`` (setting, target, method, k, labels_used,
accuracy, repeat, selected_pool_accuracy), ``reports/ddcf.json`` (the resolved config, predictor
AUCs, the pool's correctness matrix summary), and one MLflow child run per row of the table.
"""

from __future__ import annotations

from prefect import flow

from flows.stage import stage_context, stage_run, write_table
from tasks.common.config import to_dict
from tasks.common.io import write_json
from tasks.common.tracking import tracked_run
from tasks.curation.ddcf import SelectConfig, run_arithmetic_setting, summarize


@flow(name="select", log_prints=True)
def select_flow(
    root: str = ".",
    preset: str | None = None,
    workdir: str | None = None,
    runner: str | None = None,
    parent_run_id: str | None = None,
) -> dict:
    ctx = stage_context(root, preset, workdir, runner, parent_run_id)
    cfg = ctx.config(SelectConfig, "select")
    with stage_run(ctx, "select", cfg) as run:
        result = run_arithmetic_setting(cfg, log=print)
        write_table(ctx, "ddcf", result.rows, run)
        summary = ctx.layout.reports / "ddcf.json"
        write_json(summary, {"config": to_dict(cfg), "metrics": result.metrics,
                             "pool_models": int(result.matrix.shape[0]), "seed_questions": int(result.matrix.shape[1]),
                             "pool_seed_accuracy": [float(a) for a in result.matrix.mean(1)]})
        run.log_artifact(summary, "reports")
        run.log_metrics(result.metrics)
        # the mean over repeats per (target, method, k), as one stage-level metric each
        run.log_metrics({f"accuracy.{r['target']}.{r['method']}.k{r['k']}": r["accuracy"]
                         for r in summarize(result.rows).iter_rows(named=True)})
        for row in result.rows:
            name = f"select:{row['target']}:{row['method']}@{row['k']}" + (f"#{row['repeat']}" if row["repeat"] else "")
            params = {"stage": "select", "preset": ctx.preset, "setting": row["setting"], "target": row["target"],
                      "method": row["method"], "k": row["k"], "repeat": row["repeat"]}
            with tracked_run(name, uri=ctx.tracking_uri, experiment=ctx.experiment, parent=run.ref(),
                             params=params, tags={"scalelab.stage": "select", "scalelab.preset": ctx.preset}) as child:
                child.log_metrics({"accuracy": row["accuracy"], "labels_used": row["labels_used"],
                                   "selected_pool_accuracy": row["selected_pool_accuracy"]})
        print(f"select: {len(result.rows)} rows -> {ctx.layout.reports / 'ddcf.csv'}")
        return {"rows": result.rows, "metrics": result.metrics}
