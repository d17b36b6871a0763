"""The stage reports under ``reports/`` as the summary and the metrics read them: loaded, checked, and
what is missing named (never guessed, never 0)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from flows.stage import finished, read_failures

# What each stage writes that the summary reads, and the command that writes it.
REPORT_FILES: dict[str, str] = {
    "prepare.json": "prepare",
    "curation.csv": "curate",
    "train.csv": "train",
    "compress.csv": "compress",
    "sparse_eval.csv": "sparse_eval",
    "downstream.csv": "evaluate",
    "fits.json": "fit",
    "compute_optimal.csv": "fit",
}
# Optional extras: read when present, never reported missing (the prune stage is not part of every run).
OPTIONAL_FILES = ("downstream_comparisons.csv", "pruning.csv", "decisions.csv", "feasibility.csv")
# Columns the summary needs from each CSV (a file without one is refused, naming it).
REQUIRED_COLUMNS: dict[str, tuple[str, ...]] = {
    "curation.csv": ("variant", "docs_in", "docs_kept", "tokens_kept"),
    "train.csv": ("variant", "run", "val_loss"),
    "compress.csv": ("variant", "run", "setting", "bits_per_weight", "delta_val_loss"),
    "sparse_eval.csv": ("variant", "run", "setting", "sparsity", "achieved_sparsity", "delta_val_loss"),
    "downstream.csv": ("model", "method", "task", "acc", "acc_ci_low", "acc_ci_high"),
    "compute_optimal.csv": ("variant", "C", "N_opt", "D_opt", "tokens_per_param", "tokens_per_param_ci_low",
                            "tokens_per_param_ci_high", "loss_pred", "inside_measured_range"),
    "downstream_comparisons.csv": ("verdict",),
    "pruning.csv": ("variant", "model", "setting", "method", "removed_fraction", "recovery_loss", "data_select", "ppl"),
    "feasibility.csv": ("variant", "stage", "tokens", "need", "status", "reason"),
    "decisions.csv": ("variant", "reference", "target", "kind", "comparison", "budget", "delta", "ci_low", "ci_high",
                      "decision", "n_docs", "n_seeds"),
}
LAW_PARAMS = ("E", "alpha", "beta")
# compress.csv rows of the pretrained model (SmolLM2) carry this variant
PRETRAINED = "pretrained"


@dataclass
class Reports:
    """The files of one ``reports/`` folder: CSVs as frames, JSONs as dicts, what is missing."""

    folder: Path
    tables: dict[str, pl.DataFrame] = field(default_factory=dict)
    json: dict[str, Any] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # one line per unit a stage could not finish

    def table(self, name: str) -> pl.DataFrame | None:
        return self.tables.get(name)

    def missing_lines(self) -> list[str]:
        """One line per missing file naming it and the command that writes it."""
        return [f"{self.folder / name} is missing (written by `scalelab run {REPORT_FILES[name]}`)"
                for name in self.missing]


def load_reports(folder: str | Path) -> Reports:
    """Read every file of :data:`REPORT_FILES` that exists under ``folder``.

    Raises ``FileNotFoundError`` when ``folder`` itself is absent, ``ValueError`` naming the file
    (and column or key) when a file exists but cannot be read or lacks what the summary needs.
    Missing files are listed in ``Reports.missing`` (a CSV a stage wrote with no rows is present
    and empty).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no reports folder; run `scalelab run all` (or `dvc repro`) in this "
                                f"workdir first")
    out = Reports(folder=folder)
    for name in (*REPORT_FILES, *OPTIONAL_FILES):
        path = folder / name
        if not path.exists():
            if name in REPORT_FILES:
                out.missing.append(name)
            continue
        if name.endswith(".json"):
            try:
                out.json[name] = json.loads(path.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ValueError(f"{path}: not readable JSON ({exc})") from None
            continue
        out.tables[name] = finished(_read_csv(path, REQUIRED_COLUMNS.get(name, ())))  # failed units: below
    out.failures = [f"{r['stage']}: {r['unit']} failed: {r['error_type']}: {r['error']}"
                    + (f" (MLflow run {r['mlflow_run_id']})" if r["mlflow_run_id"] else "")
                    for r in read_failures(folder).iter_rows(named=True)]
    if "fits.json" in out.json:
        _check_fits(out.json["fits.json"], folder / "fits.json")
    return out


def _read_csv(path: Path, required: Sequence[str]) -> pl.DataFrame:
    if path.stat().st_size == 0:  # a stage with nothing to write (e.g. no compression setting)
        return pl.DataFrame()
    try:
        frame = pl.read_csv(path, infer_schema_length=None)
    except (pl.exceptions.PolarsError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a readable CSV ({exc})") from None
    if frame.height:
        missing = [c for c in required if c not in frame.columns]
        if missing:
            raise ValueError(f"{path}: missing column {missing[0]!r} (has {', '.join(frame.columns)})")
    return frame


def _check_fits(fits: Any, path: Path) -> None:
    if not isinstance(fits, dict) or not isinstance(fits.get("variants"), dict):
        raise ValueError(f"{path}: no 'variants' object (not a fits.json written by `scalelab run fit`)")
    for name, entry in fits["variants"].items():
        if not isinstance(entry, dict) or "identified" not in entry:
            raise ValueError(f"{path}: variants.{name}: no 'identified' key")
        for p in LAW_PARAMS:
            if p in entry and not (isinstance(entry[p], dict) and "value" in entry[p]):
                raise ValueError(f"{path}: variants.{name}.{p}: expected {{value, ci_low, ci_high}}")


def trained_series(reports: Reports) -> list[str]:
    """The series trained on the ladder (data variants and e.g. ``raw+repb``): train.csv's variants,
    else the fitted laws whose names have no '+' (compressed and sparse series are ``<variant>+<setting>``)."""
    train = reports.table("train.csv")
    if train is not None and train.height:
        return sorted(set(train["variant"].cast(pl.String).to_list()))
    fits = reports.json.get("fits.json", {}).get("variants", {})
    return sorted(n for n in fits if "+" not in n)


def best_runs(train: pl.DataFrame) -> dict[str, dict]:
    """Per variant its lowest finite val loss and the run that reached it."""
    ok = train.filter(pl.col("val_loss").cast(pl.Float64).is_finite())
    if "diverged" in ok.columns:
        ok = ok.filter(~pl.col("diverged").cast(pl.String).str.to_lowercase().is_in(["true", "1"]).fill_null(False))
    best = ok.sort("val_loss").group_by("variant", maintain_order=True).first()
    return {r["variant"]: r for r in best.to_dicts()}
