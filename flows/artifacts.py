"""What each stage found, as Prefect artifacts: the tables a user opens in the Prefect UI under the
flow run, each linked to the stage's MLflow run.

Each ``*_table`` function shapes a stage's rows into a short table (plain data, tested without a
server); :func:`publish_table` / :func:`publish_markdown` post them under the key
``<stage>-<preset>`` (Prefect keeps every version of a key; the UI shows the latest).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

from tasks.common.tracking import mlflow_client

log = logging.getLogger("scalelab")

MAX_ROWS = 200  # a table artifact is for reading; the full table is the CSV in reports/


def mlflow_run_url(uri: str, experiment: str, run_id: str) -> str:
    """The run's page in the MLflow UI (``$SCALELAB_MLFLOW_UI``, default http://127.0.0.1:5000: ``make ui``)."""
    base = os.environ.get("SCALELAB_MLFLOW_UI", "http://127.0.0.1:5000").rstrip("/")
    exp = mlflow_client(uri).get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp is not None else "0"
    return f"{base}/#/experiments/{exp_id}/runs/{run_id}"


def _cell(v: Any) -> Any:
    if isinstance(v, float):
        return None if not math.isfinite(v) else float(f"{v:.4g}")
    return v


def _key(stage: str, preset: str) -> str:
    return f"{stage}-{preset}".lower().replace("_", "-")


def publish_table(run: Any, stage: str, preset: str, rows: list[dict[str, Any]], title: str, notes: str = "") -> None:
    """Post ``rows`` as the table artifact ``<stage>-<preset>``, described by ``title``, ``notes``
    and a link to ``run``'s MLflow page. A Prefect API that refuses it is logged as a warning: the
    stage's results are already written and tracked."""
    from prefect.artifacts import create_table_artifact

    shown = [{k: _cell(v) for k, v in r.items()} for r in rows[:MAX_ROWS]]
    more = f" (first {MAX_ROWS} of {len(rows)} rows; all in reports/)" if len(rows) > MAX_ROWS else ""
    url = mlflow_run_url(run.uri, run.experiment, run.run_id)
    description = f"**{title}**{more}\n\n{notes}\n\nMLflow run: [{run.run_id}]({url})".replace("\n\n\n\n", "\n\n")
    try:
        create_table_artifact(table=shown, key=_key(stage, preset), description=description)
    except Exception as exc:  # noqa: BLE001 — any API failure: say so, keep the stage's outcome
        log.warning("could not publish the %s table to Prefect (%s: %s)", stage, type(exc).__name__, exc)


def publish_markdown(run: Any, stage: str, preset: str, markdown: str) -> None:
    """Post ``markdown`` (with a link to ``run``'s MLflow page) as the artifact ``<stage>-<preset>``."""
    from prefect.artifacts import create_markdown_artifact

    url = mlflow_run_url(run.uri, run.experiment, run.run_id)
    try:
        create_markdown_artifact(markdown=f"{markdown}\n\nMLflow run: [{run.run_id}]({url})", key=_key(stage, preset))
    except Exception as exc:  # noqa: BLE001
        log.warning("could not publish the %s summary to Prefect (%s: %s)", stage, type(exc).__name__, exc)


# ---------------------------------------------------------------------------------------------
# Tables per stage


def prepare_markdown(stats: Mapping[str, Any]) -> str:
    reasons = stats.get("quarantined_by_reason") or {}
    lines = ["### prepare", "", "| split | documents |", "|---|---|",
             f"| train | {stats.get('train_docs')} |", f"| val | {stats.get('val_docs')} |",
             f"| quarantined | {stats.get('quarantined')} |"]
    lines += [f"| quarantined: {k} | {v} |" for k, v in sorted(reasons.items())]
    return "\n".join(lines)


def curation_table(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per variant: documents in/kept, the share kept, decontaminated documents and the top drop reasons."""
    out = []
    for r in rows:
        drops = sorted(((k.removeprefix("dropped."), v) for k, v in r.items()
                        if k.startswith("dropped.") and isinstance(v, (int, float)) and v), key=lambda kv: -kv[1])
        docs_in = r.get("docs_in") or 0
        out.append({"variant": r["variant"], "docs_in": docs_in, "docs_kept": r.get("docs_kept"),
                    "kept_share": (r.get("docs_kept") or 0) / docs_in if docs_in else None,
                    "tokens_kept": r.get("tokens_kept"), "val_decontaminated": r.get("val_decontaminated"),
                    "top_drop_reasons": ", ".join(f"{k} {int(v)}" for k, v in drops[:3]) or "none"})
    return out


def train_table(rows: Iterable[Mapping[str, Any]], aliases: Mapping[str, str]) -> list[dict[str, Any]]:
    """Per series and budget, the best run and its registered alias (``raw@best-8192``)."""
    by_model = {model_id: alias for alias, model_id in aliases.items()}
    out = [{"series": r["variant"], "run": r["run"], "n_params": r.get("n_params_total") or r.get("n_params"),
            "tokens": r.get("tokens"), "compute_budget": r.get("compute_budget"), "val_loss": r.get("val_loss"),
            "registered": by_model[r["model_id"]]}
           for r in rows if r.get("model_id") in by_model]
    return sorted(out, key=lambda r: (r["series"], r["registered"]))


def compress_table(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    keys = ("variant", "model", "setting", "bits_per_weight", "val_loss", "ppl", "ppl_fp", "delta_val_loss",
            "bytes_on_disk")
    return sorted(({k: r.get(k) for k in keys} for r in rows),
                  key=lambda r: (str(r["variant"]), str(r["model"]), r["bits_per_weight"] or 0))


def pruning_table(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per model and setting (and recovery): parameters removed, perplexity, and whether it was kept."""
    keys = ("variant", "model", "setting", "recovery_loss", "data_select", "removed_fraction", "ppl", "status")
    return [{k: r.get(k) for k in keys} | {"kept": r.get("model_path") is not None} for r in rows]


def selection_table(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per setting, target, method and budget: test accuracy and the labels it used."""
    keys = ("setting", "target", "method", "k", "repeat", "accuracy", "labels_used", "selected_pool_accuracy", "status")
    return [{k: r.get(k) for k in keys} for r in rows]


def sparse_table(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    keys = ("model", "variant", "setting", "sparsity", "achieved_sparsity", "val_loss", "ppl", "delta_val_loss",
            "speedup", "retrieval_acc")
    return [{k: r.get(k) for k in keys} for r in rows]


def downstream_table(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    keys = ("model", "task", "acc", "acc_ci_low", "acc_ci_high", "bpb", "n_items")
    return [{k: r.get(k) for k in keys} for r in rows]


def law_table(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per fitted law: E, alpha, beta with their bootstrap intervals, the identified flag and, when
    not identified, the first reason (every reason is in reports/fits.json)."""
    out = []
    for variant, fit in sorted((report.get("variants") or {}).items()):
        if not isinstance(fit, Mapping):
            continue
        row: dict[str, Any] = {"law": variant, "n_points": fit.get("n_points")}
        for k in ("E", "alpha", "beta"):
            p = fit.get(k)
            if isinstance(p, Mapping):
                row[k] = p.get("value")
                row[f"{k}_ci"] = f"[{_cell(p.get('ci_low'))}, {_cell(p.get('ci_high'))}]"
        reasons = fit.get("identification_reasons") or []
        row["identified"] = bool(fit.get("identified"))
        row["why_not"] = "" if row["identified"] else (reasons[0] if reasons else "see fits.json")
        out.append(row)
    return out
