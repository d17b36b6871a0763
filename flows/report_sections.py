"""The parts of the summary, one function per stage report: a table of formatted strings, notes, the
plots it refers to, and the headline sentences it gives."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from flows.report_data import LAW_PARAMS, PRETRAINED, Reports, best_runs, trained_series
from tasks.scaling.report import file_safe  # the fit stage's plot names: loss_vs_compute_<series>.png


@dataclass
class Section:
    """One part of the summary: a table (strings, already formatted), notes and the plots it refers to
    (paths relative to ``reports/``)."""

    title: str
    columns: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    return f"{float(x):.{digits}g}"


def _ci(value: Any, lo: Any, hi: Any, digits: int = 3) -> str:
    if lo is None and hi is None:
        return _fmt(value, digits)
    return f"{_fmt(value, digits)} [{_fmt(lo, digits)}, {_fmt(hi, digits)}]"


def _delta(x: float | None) -> str:
    return "—" if x is None or not math.isfinite(x) else f"{x:+.3g}"


def _existing(reports: Reports, names: Iterable[str]) -> list[str]:
    return [n for n in names if (reports.folder / n).exists()]


def law_section(reports: Reports) -> tuple[Section, list[str]]:
    fits = reports.json["fits.json"]
    series = [s for s in trained_series(reports) if s in fits["variants"]]
    best = best_runs(reports.tables["train.csv"]) if "train.csv" in reports.tables else {}
    sec = Section("Scaling laws  L(N, D) = E + A/N^α + B/D^β  (95% bootstrap intervals)",
                  ["series", "runs", "E", "α", "β", "best val loss", "identified"])
    headline = []
    identified = []
    for name in series:
        e = fits["variants"][name]
        if "alpha" not in e:
            sec.rows.append([name, _fmt(e.get("n_points")), "—", "—", "—", _fmt(best.get(name, {}).get("val_loss")),
                             "not fitted"])
        else:
            sec.rows.append([name, _fmt(e.get("n_points")),
                             *(_ci(e[p]["value"], e[p].get("ci_low"), e[p].get("ci_high")) for p in LAW_PARAMS),
                             _fmt(best.get(name, {}).get("val_loss"), 4), "yes" if e["identified"] else "no"])
        if e["identified"]:
            identified.append(name)
        else:
            sec.notes.append(f"{name} not identified: " + "; ".join(e.get("identification_reasons") or ["no reason recorded"]))
    derived = [n for n in fits["variants"] if n not in series]
    if derived:
        k = sum(bool(fits["variants"][n].get("identified")) for n in derived)
        sec.notes.append(f"{len(derived)} further laws for compressed / sparse series ({k} identified) are in fits.json.")
    sec.plots = _existing(reports, [f"plots/loss_vs_compute_{file_safe(n)}.png" for n in series])
    headline.append(f"Laws: {len(identified)} of {len(series)} identified"
                    + (f" ({', '.join(identified)})." if identified else
                       " (reasons below): read them as descriptions of this ladder, not as predictions."))
    return sec, headline


def winner_section(reports: Reports) -> tuple[Section, list[str]]:
    """Who wins at the largest budget: by the laws (only between identified laws, with the bootstrap
    interval of the difference and Holm's p) and as observed on the ladder's largest budget."""
    sec = Section("Which series wins at the largest budget", ["comparison", "C (FLOPs)", "Δ loss x − y [95% CI]",
                                                               "Holm p", "verdict"])
    headline: list[str] = []
    fits = reports.json.get("fits.json")
    series = set(trained_series(reports))
    if fits is not None:
        for cmp in fits.get("comparisons", []):
            if cmp["x"] not in series or cmp["y"] not in series:
                continue
            tested = [j for j, (ins, p) in enumerate(zip(cmp["inside_measured_range"], cmp["p_holm"]))
                      if ins and p is not None]
            if not tested:
                continue
            j = tested[-1]
            verdict = cmp["better"][j] + " better" if cmp["better"][j] else "not distinguishable"
            sec.rows.append([f"{cmp['x']} vs {cmp['y']}", _fmt(cmp["compute"][j]),
                             f"{_delta(cmp['diff'][j])} [{_delta(cmp['diff_ci_low'][j])}, {_delta(cmp['diff_ci_high'][j])}]",
                             _fmt(cmp["p_holm"][j]), verdict])
            winner = cmp["better"][j]
            if not winner:
                headline.append(f"By the laws at C = {_fmt(cmp['compute'][j])}: {cmp['x']} and {cmp['y']} are not "
                                f"distinguishable (Δ {sec.rows[-1][2]}, Holm p = {_fmt(cmp['p_holm'][j])}).")
            else:
                loser = cmp["y"] if winner == cmp["x"] else cmp["x"]
                d = abs(cmp["diff"][j])
                lo, hi = sorted(abs(v) for v in (cmp["diff_ci_low"][j], cmp["diff_ci_high"][j]))
                headline.append(f"By the laws at C = {_fmt(cmp['compute'][j])}: {winner} beats {loser} by "
                                f"{d:.3g} loss [{lo:.3g}, {hi:.3g}] (Holm p = {_fmt(cmp['p_holm'][j])}).")
        skipped = [c for c in fits.get("comparisons_skipped", []) if c["x"] in series and c["y"] in series]
        if not sec.rows:
            sec.columns, sec.rows = [], []
            unidentified = sorted({v for c in skipped for v in (c["x"], c["y"])
                                   if not reports.json["fits.json"]["variants"].get(v, {}).get("identified")})
            why = (f" {len(skipped)} pair(s) skipped (fits.json comparisons_skipped): {', '.join(unidentified)} "
                   f"not identified.") if skipped else ""
            sec.notes.append("No comparison by the laws: only identified laws are compared." + why)
            headline.append("By the laws: no comparison (only identified laws are compared).")
        sec.plots = _existing(reports, ["plots/frontier.png"] + [
            f"plots/compare_{file_safe(c['x'])}__{file_safe(c['y'])}.png" for c in fits.get("comparisons", [])
            if c["x"] in series and c["y"] in series])
    train = reports.table("train.csv")
    if train is not None and train.height:
        obs = observed_at_largest_budget(train)
        if obs:
            budget, rows = obs
            sec.notes.append(f"Observed at the largest budget ({budget}), one run per point so no interval: "
                             + ", ".join(f"{r['variant']} {r['val_loss']:.4f} ({r['run']})" for r in rows) + ".")
            if len(rows) > 1:
                headline.append(f"Observed at the largest budget ({budget}): {rows[0]['variant']} has the lowest "
                                f"loss, {rows[1]['val_loss'] - rows[0]['val_loss']:.3g} below {rows[1]['variant']} "
                                f"(single runs: no interval).")
    return sec, headline


def observed_at_largest_budget(train: pl.DataFrame) -> tuple[str, list[dict]] | None:
    """Each series' best run at the ladder's largest compute budget, best first.

    IsoFLOP ladders name their budget (``compute_budget``); grid ladders (no budget) share the same
    (N, D) points across series, so the largest is the point with the most training FLOPs
    (``flops_total``, else 6ND).
    """
    best = train.filter(pl.col("val_loss").cast(pl.Float64).is_finite())
    if "diverged" in best.columns:
        best = best.filter(~pl.col("diverged").cast(pl.String).str.to_lowercase().is_in(["true", "1"]).fill_null(False))
    if not best.height:
        return None
    if "compute_budget" in best.columns and best["compute_budget"].cast(pl.Float64).drop_nulls().len():
        top = best["compute_budget"].cast(pl.Float64).max()
        at = best.filter(pl.col("compute_budget").cast(pl.Float64) == top)
        label = f"C = {_fmt(top)} FLOPs"
    else:
        c = (pl.col("flops_total").cast(pl.Float64) if "flops_total" in best.columns
             else 6.0 * pl.col("n_params").cast(pl.Float64) * pl.col("tokens").cast(pl.Float64))
        best = best.with_columns(c.alias("_C"))
        # per series its own largest run: the same grid point when series share the grid
        at = best.sort("_C", descending=True).group_by("variant", maintain_order=True).first()
        label = "largest grid point, C ≈ " + _fmt(float(at["_C"].max())) + " FLOPs"
    rows = at.sort("val_loss").group_by("variant", maintain_order=True).first().sort("val_loss")
    return label, rows.select("variant", "run", pl.col("val_loss").cast(pl.Float64)).to_dicts()


def compute_optimal_section(reports: Reports) -> tuple[Section, list[str]]:
    co = reports.tables["compute_optimal.csv"]
    fits = reports.json.get("fits.json", {}).get("variants", {})
    series = trained_series(reports)
    sec = Section("Compute-optimal allocation (from each law; 95% bootstrap intervals)",
                  ["series", "C (FLOPs)", "N*", "D*", "tokens / parameter", "loss", "identified"])
    headline = []
    for name in series:
        sub = co.filter(pl.col("variant") == name) if co.height else co
        if not sub.height:
            continue
        inside = sub.filter(pl.col("inside_measured_range").cast(pl.String).str.to_lowercase() == "true")
        row = (inside if inside.height else sub).sort("C").tail(1).to_dicts()[0]
        where = "" if inside.height else " (extrapolated)"
        sec.rows.append([name, _fmt(row["C"]) + where, _fmt(row["N_opt"]), _fmt(row["D_opt"]),
                         _ci(row["tokens_per_param"], row["tokens_per_param_ci_low"], row["tokens_per_param_ci_high"]),
                         _ci(row["loss_pred"], row.get("loss_pred_ci_low"), row.get("loss_pred_ci_high"), 4),
                         "yes" if fits.get(name, {}).get("identified") else "no"])
        if fits.get(name, {}).get("identified"):
            headline.append(f"{name} {_fmt(row['tokens_per_param'])} tokens per parameter "
                            f"[{_fmt(row['tokens_per_param_ci_low'])}, {_fmt(row['tokens_per_param_ci_high'])}] "
                            f"at C = {_fmt(row['C'])}{where}")
        else:
            headline.append(f"{name} not identified (its interval, [{_fmt(row['tokens_per_param_ci_low'])}, "
                            f"{_fmt(row['tokens_per_param_ci_high'])}] tokens per parameter, says nothing yet)")
    for name in series:
        levels = [lv for lv in fits.get(name, {}).get("isoflop", {}).get("levels", [])
                  if lv.get("used") and lv.get("N_opt") and lv.get("D_opt")]
        if levels:
            lv = max(levels, key=lambda lv: lv["C"])
            sec.notes.append(f"{name}, IsoFLOP minimum measured at C = {_fmt(lv['C'])} (a parabola through the "
                             f"ladder, no law): N* = {_fmt(lv['N_opt'])}, {_fmt(lv['D_opt'] / lv['N_opt'])} tokens "
                             f"per parameter.")
    sec.plots = _existing(reports, [f"plots/isoflop_{file_safe(n)}.png" for n in series])
    sec.notes.append("At the largest compute budget of fit.compute_budgets inside the ladder's measured range; "
                     "Chinchilla's is ~20 tokens per parameter. Intervals of laws that are not identified are wide.")
    return sec, (["Compute-optimal: " + "; ".join(headline) + "."] if headline else [])


def compression_table(compress: pl.DataFrame) -> pl.DataFrame:
    """Per (group, setting): median measured bits per weight, median/min/max rise in val loss over the
    models, and ``frontier``: no other setting of the group is as small or smaller with a lower median
    rise (the settings worth using at their width). ``group`` is ``ladder`` or ``pretrained``."""
    f = compress.with_columns(
        pl.when(pl.col("variant") == PRETRAINED).then(pl.lit("pretrained")).otherwise(pl.lit("ladder")).alias("group"),
        pl.col("bits_per_weight").cast(pl.Float64), pl.col("delta_val_loss").cast(pl.Float64))
    t = (f.group_by("group", "setting", maintain_order=True)
         .agg(pl.col("bits_per_weight").median().alias("bits_per_weight"),
              pl.col("delta_val_loss").median().alias("delta_median"),
              pl.col("delta_val_loss").min().alias("delta_min"), pl.col("delta_val_loss").max().alias("delta_max"),
              pl.len().alias("models"))
         .sort("group", "bits_per_weight", "delta_median"))
    frontier = []
    for r in t.iter_rows(named=True):
        rivals = t.filter((pl.col("group") == r["group"]) & (pl.col("bits_per_weight") <= r["bits_per_weight"])
                          & (pl.col("delta_median") < r["delta_median"]))
        frontier.append(rivals.height == 0)
    return t.with_columns(pl.Series("frontier", frontier, pl.Boolean))


def compression_section(reports: Reports) -> tuple[Section, list[str]]:
    compress = reports.tables["compress.csv"]
    sec = Section("Compression at equal bits per weight (rise in val loss over the dense model)",
                  ["models", "setting", "bits / weight", "median Δ loss [min, max]", "n", "best at ≤ this width"])
    if not compress.height:
        sec.notes.append("compress.csv has no rows (no compression setting enabled).")
        return sec, []
    t = compression_table(compress)
    for r in t.iter_rows(named=True):
        sec.rows.append([r["group"], r["setting"], _fmt(r["bits_per_weight"]),
                         f"{_delta(r['delta_median'])} [{_delta(r['delta_min'])}, {_delta(r['delta_max'])}]",
                         _fmt(r["models"]), "✓" if r["frontier"] else ""])
    front = t.filter(pl.col("frontier") & (pl.col("group") == "ladder"))
    sec.notes.append("bits / weight is measured (codes, scales, zeros, codebooks, outliers): compare settings at "
                     "equal bits / weight, not at equal nominal bits. ✓: no setting as small or smaller loses less.")
    headline = []
    if front.height:
        headline.append("Compression (ladder, median over models): " + "; ".join(
            f"{r['setting']} at {_fmt(r['bits_per_weight'])} bits/weight, Δ loss {_delta(r['delta_median'])}"
            for r in front.iter_rows(named=True)) + " — the settings no smaller one beats.")
    return sec, headline


def sparse_section(reports: Reports) -> tuple[Section, list[str]]:
    sparse = reports.tables["sparse_eval.csv"]
    sec = Section("Sparse inference at equal sparsity (rise in val loss over the dense model)",
                  ["level", "setting", "achieved", "median Δ loss [min, max]", "n", "best at this level"])
    if not sparse.height:
        sec.notes.append("sparse_eval.csv has no rows (no sparse setting enabled).")
        return sec, []
    f = sparse.with_columns(pl.col("sparsity").cast(pl.Float64), pl.col("achieved_sparsity").cast(pl.Float64),
                            pl.col("delta_val_loss").cast(pl.Float64))
    t = (f.group_by("sparsity", "setting", maintain_order=True)
         .agg(pl.col("achieved_sparsity").median().alias("achieved"),
              pl.col("delta_val_loss").median().alias("delta_median"),
              pl.col("delta_val_loss").min().alias("delta_min"), pl.col("delta_val_loss").max().alias("delta_max"),
              pl.len().alias("models"))
         .sort("sparsity", "delta_median"))
    best_lines = []
    for (level,), g in t.group_by("sparsity", maintain_order=True):
        for i, r in enumerate(g.iter_rows(named=True)):
            sec.rows.append([_fmt(level), r["setting"], _fmt(r["achieved"]),
                             f"{_delta(r['delta_median'])} [{_delta(r['delta_min'])}, {_delta(r['delta_max'])}]",
                             _fmt(r["models"]), "✓" if i == 0 else ""])
        top = g.row(0, named=True)
        best_lines.append(f"{top['setting']} (Δ loss {_delta(top['delta_median'])})")
    sec.notes.append("A level is the share skipped: weight reads for activation sparsity (TEAL, WINA), causal "
                     "KV pairs for attention sparsity (QuoKA, ProxyAttn); `achieved` is what was measured.")
    if "model" in f.columns and "variant" in f.columns:
        for r in f.filter(pl.col("variant").cast(pl.String) == PRETRAINED).iter_rows(named=True):
            extra = [f"ppl {_fmt(r.get('ppl'))} (dense {_fmt(math.exp(r['dense_val_loss']))})"
                     if r.get("ppl") is not None and r.get("dense_val_loss") is not None else None,
                     f"retrieval {_fmt(r.get('retrieval_acc'))} (dense {_fmt(r.get('dense_retrieval_acc'))})"
                     if r.get("retrieval_acc") is not None else None,
                     f"speed-up {_fmt(r.get('speedup'))}x" if r.get("speedup") is not None else None]
            sec.notes.append(f"{r['model']} {r['setting']} (achieved {_fmt(r['achieved_sparsity'])}): "
                             + ", ".join(x for x in extra if x) + ".")
    return sec, ["Sparse, best per level (median rise in loss): " + "; ".join(best_lines) + "."]


def common_recovery(pruning: pl.DataFrame) -> tuple[str, str] | None:
    """The (loss, data selector) recovery run that every pruned model with a recovery has (the first
    in row order when several are), or None. With ``recovery.compare_settings`` some settings get
    every run and others only the first, so this is the one run the whole table can be compared on."""
    rec = pruning.filter((pl.col("method") != "dense") & (pl.col("recovery_loss").cast(pl.String) != "none"))
    groups = [set(zip(g["recovery_loss"].cast(pl.String), g["data_select"].cast(pl.String)))
              for _, g in rec.group_by("variant", "model", "setting", maintain_order=True)]
    shared = set.intersection(*groups) if groups else set()
    order = zip(rec["recovery_loss"].cast(pl.String), rec["data_select"].cast(pl.String))
    return next((pair for pair in order if pair in shared), None)


def pruning_table(pruning: pl.DataFrame) -> list[dict[str, Any]]:
    """Per pruned model (``variant/model`` and setting): its method, removed share of the parameters,
    the dense model's and the pruned model's perplexity, the perplexity after the recovery run every
    pruned model has (:func:`common_recovery`; ``ppl_common``), and the recovery run (loss, data
    selector) that ended lowest, with its perplexity (None when no recovery ran or none is finite)."""
    common = common_recovery(pruning)
    f = pruning.with_columns(pl.col("ppl").cast(pl.Float64), pl.col("removed_fraction").cast(pl.Float64),
                             pl.col("recovery_loss").cast(pl.String), pl.col("data_select").cast(pl.String),
                             pl.concat_str(pl.col("variant").cast(pl.String), pl.lit("/"),
                                           pl.col("model").cast(pl.String)).alias("pruned_from"))
    dense = {r["pruned_from"]: r["ppl"] for r in f.filter(pl.col("method") == "dense").iter_rows(named=True)}
    out = []
    for (name, setting), g in f.filter(pl.col("method") != "dense").group_by("pruned_from", "setting",
                                                                           maintain_order=True):
        pruned = g.filter(pl.col("recovery_loss") == "none")
        recovered = g.filter((pl.col("recovery_loss") != "none") & pl.col("ppl").is_finite()).sort("ppl")
        best = recovered.row(0, named=True) if recovered.height else None
        first = (pruned if pruned.height else g).row(0, named=True)
        same = g.filter((pl.col("recovery_loss") == common[0]) & (pl.col("data_select") == common[1])) \
            if common else g.clear()
        out.append({"model": name, "setting": setting, "method": first["method"],
                    "removed_fraction": first["removed_fraction"], "ppl_dense": dense.get(name),
                    "ppl_pruned": pruned["ppl"][0] if pruned.height else None,
                    "ppl_common": same["ppl"][0] if same.height else None,
                    "ppl_recovered": best["ppl"] if best else None,
                    "recovery_loss": best["recovery_loss"] if best else None,
                    "data_select": best["data_select"] if best else None})
    return out


def pruning_section(reports: Reports) -> tuple[Section, list[str]]:
    pruning = reports.tables["pruning.csv"]
    sec = Section("Pruning and recovery (validation perplexity)",
                  ["model", "setting", "method", "removed", "ppl dense", "ppl pruned", "recovered", "best recovered",
                   "loss", "data"])
    if not pruning.height:
        sec.notes.append("pruning.csv has no rows (no pruning setting enabled).")
        return sec, []
    rows = pruning_table(pruning)
    for r in rows:
        sec.rows.append([r["model"], r["setting"], r["method"], f"{r['removed_fraction']:.1%}"
                         if r["removed_fraction"] is not None and math.isfinite(r["removed_fraction"]) else "—",
                         _fmt(r["ppl_dense"]), _fmt(r["ppl_pruned"]), _fmt(r["ppl_common"]), _fmt(r["ppl_recovered"]),
                         r["recovery_loss"] or "—", r["data_select"] or "—"])
    common = common_recovery(pruning)
    sec.notes.append("removed: share of the dense model's parameters. "
                     + (f"recovered: after the recovery run every pruned model has ({common[0]} on {common[1]} "
                        "windows), the column to compare pruning methods on. " if common else "")
                     + "best recovered: the lowest perplexity over the recovery runs (distillation loss, data "
                     "selector) from that pruned model; settings outside `recovery.compare_settings` have one run.")
    if (reports.folder / "pruning_recovery.csv").exists():
        sec.notes.append("Perplexity during each recovery run: pruning_recovery.csv"
                         + (" and the plot below." if (reports.folder / "pruning" / "recovery.png").exists() else "."))
    sec.plots += _existing(reports, ["pruning/recovery.png"])
    done = [r for r in rows if r["ppl_recovered"] is not None]
    if not done:
        return sec, []
    best = min(done, key=lambda r: r["ppl_recovered"])
    return sec, [f"Pruning: {best['model']} {best['setting']} ({best['removed_fraction']:.1%} of the parameters "
                 f"removed) went from perplexity {_fmt(best['ppl_dense'])} to {_fmt(best['ppl_pruned'])}, and "
                 f"{_fmt(best['ppl_recovered'])} after recovery by {best['recovery_loss']} on "
                 f"{best['data_select']} windows (the lowest recovered perplexity)."]


def downstream_section(reports: Reports) -> tuple[Section, list[str]]:
    down = reports.tables["downstream.csv"]
    sec = Section("Downstream accuracy (uncompressed models; 95% Wilson intervals)",
                  ["task", "best ladder model", "acc", "pretrained", "acc (pretrained)", "chance", "items"])
    if not down.height:
        sec.notes.append("downstream.csv has no rows.")
        return sec, []
    base = down.filter(pl.col("method").cast(pl.String) == "none")
    ladder = base.filter(pl.col("family") == "ladder") if "family" in base.columns else base
    other = base.filter(pl.col("family") != "ladder") if "family" in base.columns else base.clear()
    headline = []
    for (task,), g in ladder.group_by("task", maintain_order=True):
        top = g.sort("acc", descending=True).row(0, named=True)
        pre = other.filter(pl.col("task") == task).sort("acc", descending=True)
        pre_row = pre.row(0, named=True) if pre.height else None
        sec.rows.append([task, top["model"], _ci(top["acc"], top["acc_ci_low"], top["acc_ci_high"]),
                         pre_row["model"] if pre_row else "—",
                         _ci(pre_row["acc"], pre_row["acc_ci_low"], pre_row["acc_ci_high"]) if pre_row else "—",
                         _fmt(top.get("chance")), _fmt(top.get("n_items"))])
        headline.append(f"{task} {_fmt(top['acc'])}")
    comps = reports.table("downstream_comparisons.csv")
    if comps is not None and comps.height:
        counts = comps["verdict"].value_counts(sort=True)
        sec.notes.append("Compressed / sparse vs their base model, paired per item: " + ", ".join(
            f"{r['count']} {r['verdict']}" for r in counts.iter_rows(named=True)) + " (downstream_comparisons.csv).")
    return sec, (["Downstream, best ladder model per task: " + ", ".join(headline)
                  + " (tiny models: compare with the chance column)."] if headline else [])


def curation_section(reports: Reports) -> Section:
    cur = reports.tables["curation.csv"]
    sec = Section("Data variants", ["variant", "docs kept", "tokens kept", "val docs decontaminated"])
    for r in cur.iter_rows(named=True):
        sec.rows.append([r["variant"], f"{_fmt(r['docs_kept'])} of {_fmt(r['docs_in'])}", _fmt(r["tokens_kept"]),
                         _fmt(r.get("val_decontaminated"))])
    return sec


def feasibility_section(reports: Reports) -> tuple[Section, list[str]]:
    """The train stage's feasibility check (feasibility.csv): per variant its training tokens, whether
    it trained all its points, some (shrunk) or none (skipped), and the later stages it was left out of;
    a headline line per variant left untrained."""
    table = reports.tables["feasibility.csv"]
    sec = Section("Feasibility: what each variant's tokens allowed (reports/feasibility.csv)",
                  ["variant", "tokens", "training", "left out of"])
    for variant in dict.fromkeys(table["variant"].to_list()):
        mine = table.filter(pl.col("variant") == variant).to_dicts()
        train = next((r for r in mine if r["stage"] == "train"), None)
        out = [r["stage"] for r in mine if r["stage"] != "train" and r["status"] in ("skipped", "failed")]
        sec.rows.append([variant, _fmt(mine[0]["tokens"]), train["status"] if train else "—", ", ".join(out) or "—"])
        sec.notes += [f"{variant}: {r['stage']} {r['status']}: {r['reason']}" for r in mine if r["status"] != "ok"]
    untrained = table.filter((pl.col("stage") == "train") & (pl.col("status") != "ok") & (pl.col("status") != "shrunk"))
    return sec, [f"{r['variant']} was not trained ({r['status']} by the feasibility check): {r['reason']}"
                 for r in untrained.iter_rows(named=True)]


def _verdict(r: dict, unit: str = "nats") -> str:
    """``better by 0.021 [0.012, 0.030] nats`` / ``undecided: +0.004 [-0.003, 0.011]``."""
    ci = f"[{_fmt(r['ci_low'])}, {_fmt(r['ci_high'])}]"
    if r["decision"] == "undecided":
        return f"undecided: {_delta(r['delta'])} {ci} {unit}"
    return f"{r['decision']} by {_fmt(abs(r['delta']))} {ci} {unit}"


def decision_lines(reports: Reports) -> list[str]:
    """One line per compared series (decisions.csv, fits.json's nested test): the observed paired
    Delta at the largest budget on the whole validation split, each projected budget, whether the
    series moves the exponents, and the sources where it is decidedly better or worse."""
    table = reports.table("decisions.csv")
    if table is None or not table.height:
        return []
    decisions = reports.json.get("fits.json", {}).get("decisions", {})
    nested = decisions.get("nested", {})
    rows = table.to_dicts()
    lines = []
    for name in sorted({r["variant"] for r in rows}):
        mine = [r for r in rows if r["variant"] == name]
        ref = mine[0]["reference"]
        parts = []
        obs = [r for r in mine if r["kind"] == "observed" and r["comparison"] == "best" and r["target"] == "val"]
        if obs:
            top = max(obs, key=lambda r: float(r["budget"]))
            unit = "tokens" if top.get("budget_kind") == "tokens" else "FLOPs"
            seeds = f", {top['n_seeds']} seeds" if top.get("n_seeds") and int(top["n_seeds"]) > 1 else ""
            parts.append(f"{_verdict(top)} at {float(top['budget']):.2g} {unit} ({top['n_docs']:,} docs{seeds})")
        for r in sorted((r for r in mine if r["kind"] == "projected"), key=lambda r: float(r["budget"])):
            flag = " (repeats data)" if r.get("repeats_data") else ""
            parts.append(f"projected at {float(r['budget']):.2g}: {_verdict(r)}{flag}")
        if name in nested:
            n = nested[name]
            answer = {"yes": "moved", "no": "not moved", "cannot tell": "cannot tell"}[n["moves_exponents"]]
            parts.append(f"exponents: {answer} (p = {_fmt(n['p_holm'], 2)})")
        sources = [r for r in mine if r["kind"] == "observed" and r["comparison"] == "best"
                   and str(r["target"]).startswith("val:") and r["decision"] != "undecided"
                   and obs and r["budget"] == max(float(o["budget"]) for o in obs)]
        if sources:
            parts.append("by source: " + ", ".join(f"{r['target'][4:]} {r['decision']} {_delta(r['delta'])}"
                                                   for r in sources))
        bpb = [r for r in mine if r["target"] == "downstream_bpb"]
        if bpb:
            top = max(bpb, key=lambda r: float(r["budget"]))
            parts.append(f"downstream bpb: {_verdict(top, 'bits/byte')}")
        lines.append(f"{name} vs {ref}: " + "; ".join(parts) if parts else f"{name} vs {ref}: no comparison made")
    backtest = decisions.get("backtest") or {}
    if backtest.get("pairs"):
        lines.append(f"Backtest (fit without the largest budget, predict Delta there): sign right in "
                     f"{sum(p['sign_right'] for p in backtest['pairs'])} of {len(backtest['pairs'])} pairs, "
                     f"interval covers the observed Delta in {sum(p['covered'] for p in backtest['pairs'])} "
                     f"of {len(backtest['pairs'])}.")
    sigma = (decisions.get("sigma_seed") or {}).get("value")
    lines.append("Delta = loss(series) - loss(reference) on the same validation documents, best run per budget; "
                 "95% intervals over documents" + (f" and seeds (sigma_seed {_fmt(sigma)} nats, the seed spread of a one-seed Delta)" if sigma else "")
                 + "; better/worse after Holm's correction; every target and ladder point in reports/decisions.csv.")
    return lines
