"""The findings summary and the headline metrics, on small hand-made reports folders."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from flows.report import build_summary, summary_markdown, write_summary
from flows.report_data import load_reports
from flows.report_metrics import HEADLINE_STAGES, stage_metrics, write_stage_metrics
from flows.report_sections import common_recovery, compression_table, pruning_table

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def law(alpha: float, identified: bool, reasons: list[str] | None = None, n_points: int = 12) -> dict:
    p = lambda v, lo, hi: {"value": v, "ci_low": lo, "ci_high": hi}  # noqa: E731
    return {"E": p(1.5, 1.4, 1.6), "A": p(400.0, 300.0, 500.0), "B": p(900.0, 800.0, 1000.0),
            "alpha": p(alpha, alpha - 0.1, alpha + 0.1), "beta": p(0.3, 0.25, 0.35), "n_points": n_points,
            "identified": identified, "identification_reasons": reasons or [], "isoflop": {"levels": [
                {"C": 1e12, "used": True, "N_opt": 5e4, "D_opt": 1e6}]}}


def comparison(x: str, y: str, diff: float, lo: float, hi: float, p: float) -> dict:
    better = (x if diff < 0 else y) if p <= 0.05 else None
    return {"x": x, "y": y, "compute": [1e11, 1e12, 1e13], "inside_measured_range": [True, True, False],
            "diff": [diff / 2, diff, diff * 2], "diff_ci_low": [lo / 2, lo, lo * 2], "diff_ci_high": [hi / 2, hi, hi * 2],
            "p_holm": [0.5, p, None], "better": [None, better, None]}


def make_reports(folder: Path, *, variants=("raw", "dedup"), identified=(True, True), comparisons=None,
                 settings=("rtn_w4_g32", "gptq_w3_g32", "rtn_w8"), sparse=("teal@0.5", "wina@0.5"),
                 tasks=("arc_easy", "piqa")) -> Path:
    """A reports/ folder as the stages write it: an IsoFLOP ladder of 2 budgets x 2 sizes per variant."""
    folder.mkdir(parents=True, exist_ok=True)
    train, co, comp, sp, down = [], [], [], [], []
    for k, v in enumerate(variants):
        for budget in (1e11, 1e12):
            for n in (2e4, 6e4):
                loss = 4.0 - 0.3 * (budget == 1e12) - 0.1 * (n == 6e4) + 0.05 * k
                run = f"d{int(n / 1e3)}_C{budget:.0e}"
                train.append({"variant": v, "run": run, "n_params": n, "tokens": budget / (6 * n),
                              "compute_budget": budget, "flops_total": budget, "val_loss": loss, "diverged": False})
                for j, s in enumerate(settings):
                    bpw = {"rtn_w4_g32": 5.0, "gptq_w3_g32": 4.0, "rtn_w8": 9.0}.get(s, 3.0 + j)
                    comp.append({"variant": v, "run": run, "setting": s, "bits_per_weight": bpw,
                                 "delta_val_loss": {"rtn_w4_g32": 0.05, "gptq_w3_g32": 0.04, "rtn_w8": 0.0}.get(s, 0.1 + j)})
                for j, s in enumerate(sparse):
                    sp.append({"variant": v, "run": run, "setting": s, "sparsity": float(s.split("@")[1]),
                               "achieved_sparsity": float(s.split("@")[1]), "delta_val_loss": 0.03 + 0.01 * j})
                for t in tasks:
                    down.append({"model": f"{v}/{run}", "family": "ladder", "variant": v, "run": run, "method": "none",
                                 "task": t, "n_items": 50, "acc": 0.3 + 0.1 * (n == 6e4), "acc_ci_low": 0.2,
                                 "acc_ci_high": 0.5, "chance": 0.25})
        for c in (1e11, 1e12, 1e13):
            co.append({"variant": v, "C": c, "N_opt": c ** 0.5 / 10, "D_opt": c ** 0.5, "tokens_per_param": 10.0 + k,
                       "tokens_per_param_ci_low": 5.0, "tokens_per_param_ci_high": 30.0, "loss_pred": 3.0 + 0.05 * k,
                       "loss_pred_ci_low": 2.9, "loss_pred_ci_high": 3.2, "inside_measured_range": c <= 1e12})
    pl.DataFrame(train).write_csv(folder / "train.csv")
    pl.DataFrame(co).write_csv(folder / "compute_optimal.csv")
    pl.DataFrame(comp).write_csv(folder / "compress.csv")
    pl.DataFrame(sp).write_csv(folder / "sparse_eval.csv")
    pl.DataFrame(down).write_csv(folder / "downstream.csv")
    pl.DataFrame([{"variant": v, "docs_in": 100, "docs_kept": 100 - 10 * k, "tokens_kept": 5000 - 100 * k,
                   "val_decontaminated": 1} for k, v in enumerate(variants)]).write_csv(folder / "curation.csv")
    (folder / "prepare.json").write_text(json.dumps({"train_docs": 100, "val_docs": 10}))
    laws = {v: law(0.3 + 0.02 * k, ok, None if ok else ["alpha's 95% interval [0.1, 5] is wider than max_ci_width=0.4"])
            for k, (v, ok) in enumerate(zip(variants, identified))}
    laws |= {f"{variants[0]}+{settings[0]}": law(0.3, False, ["too few points"])}
    skipped = [] if all(identified) else [{"x": variants[0], "y": variants[1], "reason": "not identified"}]
    (folder / "fits.json").write_text(json.dumps({"variants": laws, "comparisons": comparisons or [],
                                                  "comparisons_skipped": skipped}))
    (folder / "plots").mkdir(exist_ok=True)
    (folder / "plots" / "frontier.png").write_bytes(b"\x89PNG")
    return folder


def test_identified_laws_are_compared_with_the_difference_and_its_interval(tmp_path: Path):
    reports = make_reports(tmp_path / "reports", comparisons=[comparison("dedup", "raw", -0.05, -0.08, -0.02, 0.01)])
    summary = build_summary(load_reports(reports))
    text = "\n".join(summary.headline)
    assert "Laws: 2 of 2 identified (dedup, raw)." in text
    # the winner at the largest tested budget (1e13 is outside the measured range, so 1e12), by how much, interval
    assert "By the laws at C = 1e+12: dedup beats raw by 0.05 loss [0.02, 0.08] (Holm p = 0.01)." in text
    assert "raw 10 tokens per parameter [5, 30] at C = 1e+12" in text
    md = summary_markdown(summary)
    assert "| dedup vs raw | 1e+12 | -0.05 [-0.08, -0.02] | 0.01 | dedup better |" in md
    assert "![frontier](plots/frontier.png)" in md and summary.missing == []
    # the compressed series' law is counted, not listed as a variant
    assert "1 further laws for compressed / sparse series (0 identified)" in md


def test_identified_laws_that_do_not_differ_are_said_to_be_not_distinguishable(tmp_path: Path):
    reports = make_reports(tmp_path / "reports", comparisons=[comparison("dedup", "raw", 0.01, -0.02, 0.04, 0.3)])
    assert ("By the laws at C = 1e+12: dedup and raw are not distinguishable (Δ +0.01 [-0.02, +0.04], Holm p = 0.3)."
            in build_summary(load_reports(reports)).headline)


def test_a_law_that_is_not_identified_says_why_and_is_not_compared(tmp_path: Path):
    reports = make_reports(tmp_path / "reports", identified=(True, False))
    summary = build_summary(load_reports(reports))
    md = summary_markdown(summary)
    assert "- dedup not identified: alpha's 95% interval [0.1, 5] is wider than max_ci_width=0.4" in md
    assert "No comparison by the laws: only identified laws are compared. 1 pair(s) skipped" in md
    assert "dedup not identified (its interval, [5, 30] tokens per parameter, says nothing yet)" in md
    # observed at the largest budget (1e12): raw's best run 3.6, dedup's 3.65
    assert ("Observed at the largest budget (C = 1e+12 FLOPs): raw has the lowest loss, 0.05 below dedup "
            "(single runs: no interval).") in summary.headline
    law_rows = next(s for s in summary.sections if s.title.startswith("Scaling laws")).rows
    assert [r[0] for r in law_rows] == ["dedup", "raw"] and [r[-1] for r in law_rows] == ["no", "yes"]


def test_compression_frontier_is_judged_at_equal_bits_per_weight():
    t = compression_table(pl.DataFrame({
        "variant": ["raw"] * 4, "setting": ["a3", "b4", "c5", "d5"], "bits_per_weight": [3.0, 4.0, 5.0, 5.0],
        "delta_val_loss": [0.2, 0.04, 0.05, 0.01]}))
    # c5 is as wide as d5 and loses more, and wider than b4 and loses more: not on the frontier
    assert dict(zip(t["setting"], t["frontier"])) == {"a3": True, "b4": True, "c5": False, "d5": True}


def test_missing_files_are_named_and_what_exists_is_summarised(tmp_path: Path, capsys):
    from flows.cli import main

    reports = make_reports(tmp_path / "reports")
    (reports / "compress.csv").unlink()
    (reports / "fits.json").unlink()
    summary, path = write_summary(reports)
    assert summary.missing == [f"{reports / 'compress.csv'} is missing (written by `scalelab run compress`)",
                               f"{reports / 'fits.json'} is missing (written by `scalelab run fit`)"]
    titles = [s.title.split(" ")[0] for s in summary.sections]
    assert "Compression" not in titles and "Scaling" not in titles and "Sparse" in titles and "Which" in titles
    assert "**Incomplete workdir:**" in path.read_text()
    assert main(["report", "--workdir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "incomplete workdir" in err and "compress.csv is missing" in err
    with pytest.raises(FileNotFoundError, match="no reports folder"):
        load_reports(tmp_path / "elsewhere")


def pruning_rows() -> list[dict]:
    """reports/pruning.csv as the prune stage writes it: a dense row, then per setting the pruned row and
    one row per recovery run (loss, data selector); one setting whose recovery diverged."""
    base = {"variant": "raw", "model": "d64_l3", "run": "d64_l3", "granularity": "layer"}
    rows = [base | {"setting": "dense", "method": "dense", "removed_fraction": 0.0, "recovery_loss": "none",
                    "data_select": "none", "ppl": 20.0, "params": 1000, "model_path": None}]
    for setting, method, frac, ppl, recovered in (
            ("entrodrop_l1", "entrodrop", 0.25, 40.0, {("csd", "random"): 30.0, ("kl", "random"): 28.0,
                                                       ("csd", "paser"): 29.0}),
            ("cosine_l1", "cosine_drop", 0.25, 50.0, {("csd", "random"): float("nan")})):
        rows.append(base | {"setting": setting, "method": method, "removed_fraction": frac, "recovery_loss": "none",
                            "data_select": "none", "ppl": ppl, "params": 750, "model_path": None})
        rows += [base | {"setting": setting, "method": method, "removed_fraction": frac, "recovery_loss": loss,
                         "data_select": select, "ppl": v, "params": 750,
                         "model_path": f"models/pruned/raw/d64_l3/{setting}+{loss}+{select}"}
                 for (loss, select), v in recovered.items()]
    return rows


def test_pruning_section_gives_the_best_recovery_per_pruned_model(tmp_path: Path):
    reports = make_reports(tmp_path / "reports")
    # no prune stage: no section, and pruning.csv is not reported missing
    summary = build_summary(load_reports(reports))
    assert not any(s.title.startswith("Pruning") for s in summary.sections) and summary.missing == []
    pl.DataFrame(pruning_rows()).write_csv(reports / "pruning.csv")
    summary = build_summary(load_reports(reports))
    sec = next(s for s in summary.sections if s.title.startswith("Pruning"))
    # "recovered": the run both settings have (csd on random windows; the cosine one diverged)
    assert sec.rows == [["raw/d64_l3", "entrodrop_l1", "entrodrop", "25.0%", "20", "40", "30", "28", "kl", "random"],
                        ["raw/d64_l3", "cosine_l1", "cosine_drop", "25.0%", "20", "50", "—", "—", "—", "—"]]
    assert any("every pruned model has (csd on random windows)" in n for n in sec.notes)
    assert sec.plots == [] and not any("pruning_recovery.csv" in n for n in sec.notes)
    assert ("Pruning: raw/d64_l3 entrodrop_l1 (25.0% of the parameters removed) went from perplexity 20 to 40, "
            "and 28 after recovery by kl on random windows (the lowest recovered perplexity).") in summary.headline
    # with the recovery curves and their plot: pointed to, and the plot embedded
    (reports / "pruning_recovery.csv").write_text("step,ppl\n0,40\n")
    (reports / "pruning").mkdir()
    (reports / "pruning" / "recovery.png").write_bytes(b"\x89PNG")
    summary, path = write_summary(reports)
    md = path.read_text()
    assert "## Pruning and recovery (validation perplexity)" in md
    assert "| raw/d64_l3 | entrodrop_l1 | entrodrop | 25.0% | 20 | 40 | 30 | 28 | kl | random |" in md
    assert "pruning_recovery.csv and the plot below." in md and "![recovery](pruning/recovery.png)" in md
    # a prune stage with no settings writes an empty file: a note, no table
    (reports / "pruning.csv").write_text("")
    sec = next(s for s in build_summary(load_reports(reports)).sections if s.title.startswith("Pruning"))
    assert sec.rows == [] and sec.notes == ["pruning.csv has no rows (no pruning setting enabled)."]


def test_bad_files_are_refused_naming_the_file_and_key(tmp_path: Path):
    reports = make_reports(tmp_path / "reports")
    pl.read_csv(reports / "train.csv").drop("val_loss").write_csv(reports / "train.csv")
    with pytest.raises(ValueError, match=r"train.csv: missing column 'val_loss'"):
        load_reports(reports)
    reports = make_reports(tmp_path / "other")
    fits = json.loads((reports / "fits.json").read_text())
    del fits["variants"]["raw"]["identified"]
    (reports / "fits.json").write_text(json.dumps(fits))
    with pytest.raises(ValueError, match=r"fits.json: variants.raw: no 'identified' key"):
        load_reports(reports)


def test_headline_metrics_keep_dvc_metrics_show_narrow(tmp_path: Path):
    """Nine variants, twelve compression and eight sparse settings, ten tasks: `dvc metrics show` on the
    project's dvc.yaml still prints no line over 1,500 characters, and every row is there."""
    variants = tuple(f"variant_{k}" for k in range(9))
    repo = tmp_path / "repo"
    reports = make_reports(repo / "reports", variants=variants, identified=(True,) * 9,
                           settings=tuple(f"setting_{k}_w{k % 4 + 2}" for k in range(12)),
                           sparse=tuple(f"method_{k % 4}@0.{k + 1}" for k in range(8)),
                           tasks=tuple(f"task_{k}" for k in range(10)))
    for stage in HEADLINE_STAGES:
        write_stage_metrics(stage, reports)
    fit = json.loads((reports / "metrics" / "fit" / "variant_3.json").read_text())
    assert fit == stage_metrics("fit", load_reports(reports))["variant_3"]
    assert set(fit) == {"identified", "points", "E", "E_lo", "E_hi", "alpha", "alpha_lo", "alpha_hi", "beta",
                        "beta_lo", "beta_hi", "best_val_loss"} and fit["best_val_loss"] == pytest.approx(3.75)
    shutil.copy(ROOT / "dvc.yaml", repo / "dvc.yaml")
    env = dict(os.environ, DVC_NO_ANALYTICS="1")
    subprocess.run([BIN / "dvc", "init", "--no-scm", "-q"], cwd=repo, env=env, check=True)
    out = subprocess.run([BIN / "dvc", "metrics", "show"], cwd=repo, env=env, capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    rows = {line.split()[0] for line in lines[1:]}
    expected = sum(len(list((reports / "metrics" / s).glob("*.json"))) for s in HEADLINE_STAGES) + 1  # + prepare.json
    assert len(rows) == expected == 1 + 9 + 9 + 12 + 8 + 10 + 9
    assert max(map(len, lines)) < 1500, max(map(len, lines))


def test_common_recovery_is_the_run_every_pruned_model_has():
    frame = pl.DataFrame(pruning_rows())
    assert common_recovery(frame) == ("csd", "random")
    # no run shared by both settings: no common column
    no_shared = frame.filter(~((pl.col("setting") == "entrodrop_l1") & (pl.col("recovery_loss") == "csd")
                               & (pl.col("data_select") == "random")))
    assert common_recovery(no_shared) is None
    assert all(r["ppl_common"] is None for r in pruning_table(no_shared))
    assert common_recovery(frame.filter(pl.col("recovery_loss") == "none")) is None
