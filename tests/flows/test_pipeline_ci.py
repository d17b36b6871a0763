"""The whole pipeline end to end with the `ci` preset: the one end-to-end run in `make test`."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import mlflow
import polars as pl
import pytest

ROOT = Path(__file__).resolve().parents[2]
from flows.cli import STAGES  # noqa: E402


def pipeline_runs(ci_run):
    """(client, experiment, runs): this pipeline's MLflow tree, the parent run's descendants (other
    tests share the store)."""
    from tasks.common.tracking import tracking_uri

    workdir, result = ci_run
    client = mlflow.MlflowClient(tracking_uri(workdir))
    exp = client.get_experiment_by_name("scalelab")
    everything = client.search_runs([exp.experiment_id], max_results=5000)
    tree, frontier = {}, {result["parent_run_id"]}
    while frontier:
        found = [r for r in everything if r.data.tags.get("mlflow.parentRunId") in frontier]
        tree.update({r.info.run_id: r for r in found})
        frontier = {r.info.run_id for r in found}
    return client, exp, list(tree.values())


def test_every_stage_writes_its_report(ci_run):
    workdir, _ = ci_run
    reports = workdir / "reports"
    for name in ("prepare.json", "curation.csv", "train.csv", "train_curves.csv", "val_by_source.csv", "compress.csv",
                 "sparse_eval.csv", "downstream.csv", "task_laws.json", "fits.json", "compute_optimal.csv"):
        assert (reports / name).exists(), name
    assert list((reports / "plots").glob("*.png")) or list(reports.glob("*.png"))


def test_variants_are_trained_on_the_shared_ladder(ci_run):
    workdir, _ = ci_run
    train = pl.read_csv(workdir / "reports" / "train.csv")
    curation = pl.read_csv(workdir / "reports" / "curation.csv")
    # every variant is decontaminated against validation; the share left is at most the share before
    assert (curation["val_decontaminated"] >= 0).all()
    assert (curation["val_ngram_share_after"] <= curation["val_ngram_share_before"]).all()
    assert set(train["data_variant"]) == set(curation["variant"]) and len(set(train["data_variant"])) >= 2
    # The ci preset compares RePB on raw: a second series at the same (N, D) and optimizer steps.
    assert set(train["variant"]) == set(curation["variant"]) | {"raw+repb"}
    arms = train.filter(pl.col("data_variant") == "raw").sort("variant", "n_params", "tokens")
    base, pruned = arms.filter(pl.col("variant") == "raw"), arms.filter(pl.col("variant") == "raw+repb")
    assert base["steps"].to_list() == pruned["steps"].to_list() and set(pruned["data_pruning"]) == {"repb"}
    # Scores are normalised within each step before pooling, so the kept fraction follows keep_ratio (0.7)
    # although the loss falls fast in these short runs.
    assert pruned["repb_kept_frac"].is_between(0.6, 0.8).all() and base["repb_kept_frac"].is_null().all()
    # The accounting columns: N both ways, one FLOPs convention, epochs, divergence.
    assert (train["n_params_total"] > train["n_params_nonembed"]).all()
    assert (train["flops_total"] > 6 * train["n_params_total"] * train["tokens"]).all()  # + attention
    assert train["epochs"].is_between(0, 1).all() and not train["diverged"].any()
    assert set(train["schedule"]) == {"wsd"} and len(set(train["tokens"])) >= 3
    # Every source of the corpus is in every run's validation loss.
    by_source = pl.read_csv(workdir / "reports" / "val_by_source.csv")
    sources = set(pl.read_parquet(workdir / "data" / "prepared" / "val.parquet")["source"])
    assert {frozenset(g["source"]) for (_,), g in by_source.group_by("run")} == {frozenset(sources)}
    # Every variant sees the same (N, D) grid and is scored on the same held-out split.
    grids = {v: set(zip(g["n_params"], g["tokens"])) for (v,), g in train.group_by("variant")}
    assert len({frozenset(g) for g in grids.values()}) == 1
    assert train["val_loss"].is_finite().all()
    # A bigger model trained on more tokens reaches a lower loss than the smallest corner.
    for (_,), g in train.group_by("variant"):
        small = g.filter((pl.col("n_params") == g["n_params"].min()) & (pl.col("tokens") == g["tokens"].min()))
        large = g.filter((pl.col("n_params") == g["n_params"].max()) & (pl.col("tokens") == g["tokens"].max()))
        assert large["val_loss"][0] < small["val_loss"][0]


def test_compression_and_sparsity_cost_loss_and_save_bytes(ci_run):
    workdir, _ = ci_run
    comp = pl.read_csv(workdir / "reports" / "compress.csv")
    assert comp.height > 0 and (comp["bytes_on_disk"] > 0).all()
    sparse = pl.read_csv(workdir / "reports" / "sparse_eval.csv")
    assert sparse.height > 0
    assert ((sparse["achieved_sparsity"] - sparse["sparsity"]).abs() < 0.05).all()


def test_downstream_tasks_score_every_model_and_fit_task_laws(ci_run):
    workdir, _ = ci_run
    reports = workdir / "reports"
    train = pl.read_csv(reports / "train.csv")
    down = pl.read_csv(reports / "downstream.csv", infer_schema_length=None)
    base = down.filter(pl.col("method") == "none")
    # every trained model on every task of the ci preset, and compressed variants beside them
    assert set(zip(base["variant"], base["run"])) == set(zip(train["variant"], train["run"]))
    assert set(down["task"]) == {"arc_easy", "piqa", "winogrande"}
    assert down.filter(pl.col("method") != "none").height > 0
    assert down["acc"].is_between(0, 1).all() and (down["acc_ci_low"] <= down["acc"]).all()
    assert (down["acc"] <= down["acc_ci_high"]).all() and (down["bpb"] > 0).all()
    # one 0/1 row per model and item: the correctness matrices the evaluation-subset work needs
    for task in set(down["task"]):
        wide = pl.read_parquet(reports / "downstream" / f"correctness_{task}.parquet")
        assert wide.height == down.filter(pl.col("task") == task)["model"].n_unique()
        assert set(wide.drop("model").unpivot()["value"].drop_nulls().unique()) <= {0, 1}
    comps = pl.read_csv(reports / "downstream_comparisons.csv", infer_schema_length=None)
    assert comps.height > 0 and set(comps["verdict"]) <= {"model better", "base better", "not distinguishable"}
    laws = json.loads((reports / "task_laws.json").read_text())
    assert set(laws["tasks"]) == set(down["task"])
    # evaluation subsets compared on those matrices, each selector at the ci size
    bench = pl.read_csv(reports / "microbench.csv", infer_schema_length=None)
    assert set(bench["task"]) == set(down["task"]) and set(bench["n"]) == {4}
    assert set(bench["method"]) == {"random", "stratified", "anchor_points", "learned_anchors"}
    assert all((reports / "microbench" / f"{t}.png").exists() for t in set(down["task"]))


def test_fits_json_has_a_law_per_variant(ci_run):
    workdir, _ = ci_run
    fits = json.loads((workdir / "reports" / "fits.json").read_text())
    train = pl.read_csv(workdir / "reports" / "train.csv")
    variants = fits["variants"]
    for v in set(train["variant"]):
        assert v in variants
        for key in ("E", "A", "B", "alpha", "beta"):
            assert {"value", "ci_low", "ci_high"} <= set(variants[v][key])
    # RePB's arm is compared with the unpruned ladder across compute when both laws are identified;
    # the ci ladder's tiny laws usually are not, and the pair is then listed as skipped with the reason.
    pair = [c for c in fits["comparisons"] if {c["x"], c["y"]} == {"raw", "raw+repb"}]
    skipped = [c for c in fits["comparisons_skipped"] if {c["x"], c["y"]} == {"raw", "raw+repb"}]
    assert len(pair) + len(skipped) == 1
    assert (isinstance(pair[0]["reversal"], bool) if pair else bool(skipped[0]["reason"]))
    for v in set(train["variant"]):
        assert isinstance(variants[v]["identified"], bool) and "backtest" in variants[v]["diagnostics"]


def test_decisions_pair_every_series_with_raw(ci_run):
    """The fit stage decides on paired differences: dedup_gopher (a data intervention) and raw+repb
    (a training method) against raw, observed at every token budget with document intervals, per
    source and on downstream bpb, projected beyond the ladder; summary.md opens with them."""
    workdir, _ = ci_run
    reports = workdir / "reports"
    rows = pl.read_csv(reports / "decisions.csv")
    assert set(rows["variant"]) == {"dedup_gopher", "raw+repb"} and set(rows["reference"]) == {"raw"}
    best = rows.filter((pl.col("kind") == "observed") & (pl.col("comparison") == "best") & (pl.col("target") == "val"))
    assert best.height == 2 * 3  # two series x three token budgets
    assert ((best["ci_low"] <= best["delta"]) & (best["delta"] <= best["ci_high"])).all()
    assert set(rows["decision"]) <= {"better", "worse", "undecided"}
    assert {"val", "downstream_bpb"} <= set(rows["target"]) and any(t.startswith("val:") for t in rows["target"])
    projected = rows.filter(pl.col("kind") == "projected")
    top = pl.read_csv(reports / "train.csv")["flops_total"].max()
    assert projected.height == 2 * 2
    assert sorted(set(projected["budget"].to_list())) == pytest.approx([3 * top, 10 * top], rel=1e-9)
    decisions = json.loads((reports / "fits.json").read_text())["decisions"]
    assert set(decisions["nested"]) == {"dedup_gopher", "raw+repb"}
    assert decisions["backtest"]["pairs"] and decisions["sigma_seed"]["dof"] >= 1  # the ci preset's second seed
    summary = (reports / "summary.md").read_text()
    assert summary.index("## Decisions") < summary.index("## Scaling laws")
    assert "dedup_gopher vs raw:" in summary and "raw+repb vs raw:" in summary


def test_mlflow_has_finished_runs_for_all_stages(ci_run):
    _, result = ci_run
    _, _, runs = pipeline_runs(ci_run)
    stages = {r.data.tags.get("scalelab.stage") for r in runs}
    # Per-variant and per-law children carry their stage too, so `params.stage = 'fit'` finds every law.
    assert stages == set(STAGES)
    laws = [r for r in runs if r.data.tags["scalelab.stage"] == "fit" and "variant" in r.data.params]
    assert {r.data.params["variant"] for r in laws} >= {"raw", "raw+repb"}
    assert {r.info.status for r in runs} == {"FINISHED"}
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == result["parent_run_id"]]
    assert {r.data.tags["scalelab.stage"] for r in children} == set(STAGES)
    trained = [r for r in runs if r.data.tags.get("scalelab.stage") == "train" and "variant" in r.data.params]
    assert trained and all({"variant", "n_params", "tokens"} <= set(r.data.params) for r in trained)
    assert all("val_loss" in r.data.metrics for r in trained)


def test_pruning_rows_dense_pruned_and_recovered(ci_run):
    workdir, _ = ci_run
    prune = pl.read_csv(workdir / "reports" / "pruning.csv", infer_schema_length=None)
    train = pl.read_csv(workdir / "reports" / "train.csv")
    # the largest run of each variant, dense and pruned by both methods, then recovered by CSD
    assert set(prune["variant"]) == set(train["variant"])
    assert set(prune["method"]) == {"dense", "entrodrop", "cosine_drop"}
    dense = prune.filter(pl.col("method") == "dense").select("variant", dense_params="params")
    pruned = prune.filter(pl.col("method") != "dense").join(dense, on="variant")
    assert (pruned["params"] < pruned["dense_params"]).all() and (pruned["removed_fraction"] > 0).all()
    assert set(zip(pruned["recovery_loss"], pruned["data_select"])) == {("none", "none"), ("csd", "random"), ("csd", "paser")}
    assert prune["ppl"].is_finite().all()


def test_recovery_curves_start_at_the_pruned_and_end_at_the_recovered_ppl(ci_run):
    from tasks.common.params import load_stage_config
    from tasks.compression.pruning import PruningConfig

    workdir, _ = ci_run
    reports = workdir / "reports"
    rc = load_stage_config(PruningConfig, ROOT, "pruning", "ci").recovery
    steps = sorted({0, rc.steps, *range(rc.curve_every, rc.steps, rc.curve_every or rc.steps)})
    prune = pl.read_csv(reports / "pruning.csv", infer_schema_length=None)
    curves = pl.read_csv(reports / "pruning_recovery.csv", infer_schema_length=None)
    recovered = prune.filter(pl.col("recovery_loss") != "none")
    keys = ["variant", "model", "setting", "recovery_loss", "data_select"]
    assert curves.select(keys).unique().height == recovered.height
    for row in recovered.iter_rows(named=True):
        curve = curves.filter(*[pl.col(k) == row[k] for k in keys]).sort("step")
        before = prune.filter(pl.col("variant") == row["variant"], pl.col("model") == row["model"],
                              pl.col("setting") == row["setting"], pl.col("recovery_loss") == "none")
        assert curve["step"].to_list() == steps
        assert curve["ppl"][0] == pytest.approx(before["ppl"][0], rel=1e-9)
        assert curve["ppl"][-1] == pytest.approx(row["ppl"], rel=1e-9)
        assert curve["recovery_tokens"][-1] == row["recovery_tokens"]
    assert (reports / "pruning" / "recovery.png").exists()
    # each recovery run's MLflow run carries the curve as a step metric
    client, _, runs = pipeline_runs(ci_run)
    rec_runs = [r for r in runs if r.data.tags.get("scalelab.stage") == "prune" and r.info.run_name.count("+") == 2]
    assert len(rec_runs) == recovered.height
    history = client.get_metric_history(rec_runs[0].info.run_id, "curve_ppl")
    assert sorted(m.step for m in history) == steps


def test_pruned_models_are_scored_downstream_against_their_base(ci_run):
    workdir, _ = ci_run
    reports = workdir / "reports"
    prune = pl.read_csv(reports / "pruning.csv", infer_schema_length=None)
    kept = prune.filter(pl.col("model_path").is_not_null())
    # pruning.save: the CSD/random recovered rows of the largest pruned ladder model, as from_pretrained folders
    assert kept.height > 0 and set(kept["recovery_loss"]) == {"csd"} and set(kept["data_select"]) == {"random"}
    assert kept.select("variant", "run").unique().height == 1
    assert all((workdir / p / "config.json").exists() for p in kept["model_path"])
    down = pl.read_csv(reports / "downstream.csv", infer_schema_length=None)
    comps = pl.read_csv(reports / "downstream_comparisons.csv", infer_schema_length=None)
    for row in kept.iter_rows(named=True):
        name = f"{row['variant']}/{row['run']}:{row['setting']}+csd+random"
        rows = down.filter(pl.col("model") == name)
        assert set(rows["task"]) == set(down["task"])
        assert set(rows["method"]) == {row["method"]} and set(rows["setting"]) == {f"{row['setting']}+csd+random"}
        assert set(rows["n_params"]) == {row["params"]}
        assert set(comps.filter(pl.col("model") == name)["base"]) == {f"{row['variant']}/{row['run']}"}


def test_mlflow_records_lineage_models_and_registry(ci_run):
    """Datasets with DVC digests on every run that reads data, git/params tags, logged models with
    their metrics (trained, compressed and pruned), one registry alias per series and budget."""
    workdir, _ = ci_run
    from tasks.common.lineage import file_md5
    from tasks.common.provenance import GIT_DIRTY, PARAMS_HASH

    client, exp, runs = pipeline_runs(ci_run)
    assert all(PARAMS_HASH in r.data.tags for r in runs)
    if (ROOT / ".git").exists():
        assert all(r.data.tags.get("mlflow.source.git.commit") and r.data.tags[GIT_DIRTY] in ("true", "false")
                   for r in runs)
    per_model = [r for r in runs if r.data.tags["scalelab.stage"] in ("train", "compress", "prune", "sparse_eval", "evaluate")
                 and "variant" in r.data.params and r.data.tags.get("mlflow.runName", "").count(":") >= 2]
    assert per_model
    for r in per_model:
        training = [d.dataset for d in r.inputs.dataset_inputs
                    if {t.key: t.value for t in d.tags}.get("mlflow.data.context") == "training"]
        assert training, r.info.run_name
        ds = training[0]
        source = json.loads(ds.source)["uri"]
        assert ds.digest == file_md5(workdir / source)  # DVC 3's hash of that file
    curated = [d.dataset for r in runs if r.info.run_name.startswith("curate:") for d in r.inputs.dataset_inputs]
    assert {d.name for d in curated} == set(pl.read_csv(workdir / "reports" / "curation.csv")["variant"])
    # the models, logged by reference with their metrics
    models = client.search_logged_models([exp.experiment_id], max_results=1000)
    train = pl.read_csv(workdir / "reports" / "train.csv")
    trained = [m for m in models if m.model_type == "scalelab-trained"]
    compressed = [m for m in models if m.model_type == "scalelab-compressed"]
    seeds = pl.read_csv(workdir / "reports" / "train_seeds.csv")  # extra-seed runs log their models too
    assert len(trained) == train.height + seeds.height and seeds.height > 0 and compressed
    assert all({"val_loss", "ppl"} <= {x.key for x in m.metrics} for m in trained)
    assert all({"val_loss", "bits_per_weight"} <= {x.key for x in m.metrics} for m in compressed)
    assert any(x.key.startswith("acc_") for m in trained for x in m.metrics)
    # the pruned models pruning.save kept, with their prune metrics and the evaluate stage's accuracy
    kept = pl.read_csv(workdir / "reports" / "pruning.csv", infer_schema_length=None).filter(
        pl.col("model_path").is_not_null())
    pruned = [m for m in models if m.model_type == "scalelab-pruned"]
    assert len(pruned) == kept.height > 0
    assert all({"ppl", "params", "flops_per_token"} <= {x.key for x in m.metrics} for m in pruned)
    assert all(any(x.key.startswith("acc_") for x in m.metrics) for m in pruned)
    # one alias per series and token budget
    for series in set(train["variant"]):
        for tokens in set(train["tokens"]):
            version = client.get_model_version_by_alias(series, f"best-{tokens}")
            best = train.filter((pl.col("variant") == series) & (pl.col("tokens") == tokens)).sort("val_loss")
            model_id = version.source.removeprefix("models:/")
            assert client.get_logged_model(model_id).tags["scalelab.model_key"] == f"{series}/{best['run'][0]}"


def test_prefect_artifacts_link_each_stage_to_its_mlflow_run(ci_run):
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    async def latest(key):
        async with get_client() as client:
            found = await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
            return found[-1] if found else None

    for stage in ("prepare", "curation", "train", "compress", "prune", "sparse-eval", "evaluate", "fit", "select"):
        art = asyncio.run(latest(f"{stage}-ci"))
        assert art is not None, stage
        assert "/#/experiments/" in (art.description or art.data), stage


def test_summary_headline_metrics_and_file_modes(ci_run):
    """What the run found is in reports/summary.md (and the pipeline's Prefect artifact), each stage's
    headline metrics have one small file per row, and every output is readable by other users."""
    import asyncio
    import os
    import stat

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.report_metrics import HEADLINE_STAGES

    workdir, result = ci_run
    reports = workdir / "reports"
    summary = (reports / "summary.md").read_text()
    assert result["summary"] == str(reports / "summary.md")
    train = pl.read_csv(reports / "train.csv")
    assert "Incomplete workdir" not in summary and "## Scaling laws" in summary
    # nothing failed: every stage's failure list is there and empty, every unit's rows are ok
    assert "## Failures" not in summary
    lists = sorted(p.stem for p in (reports / "failures").glob("*.csv"))
    assert lists == sorted(["train", "compress", "prune", "sparse_eval", "evaluate", "select"])
    assert all(pl.read_csv(reports / "failures" / f"{s}.csv").height == 0 for s in lists)
    for table in ("train.csv", "compress.csv", "pruning.csv", "sparse_eval.csv", "downstream.csv", "ddcf.csv"):
        assert set(pl.read_csv(reports / table, infer_schema_length=None)["status"]) == {"ok"}, table
    assert all(f"| {v} |" in summary for v in set(train["variant"]))
    for stage in HEADLINE_STAGES:
        rows = {p.stem for p in (reports / "metrics" / stage).glob("*.json")}
        assert rows, stage
        if stage in ("train", "fit"):
            assert rows == set(train["variant"]), stage
    assert all(len(p.read_text()) < 1000 for p in (reports / "metrics").rglob("*.json"))

    async def artifact():
        async with get_client() as client:
            found = await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["pipeline-summary"])))
            return found[-1] if found else None

    art = asyncio.run(artifact())
    assert art is not None and "Scaling laws" in art.data

    mask = os.umask(0o022)
    os.umask(mask)
    unusual = [f"{p} {stat.S_IMODE(p.stat().st_mode):o}"
               for top in ("reports", "models", "data", "mlartifacts") for p in (workdir / top).rglob("*")
               if not p.is_symlink() and stat.S_IMODE(p.stat().st_mode) != (0o777 if p.is_dir() else 0o666) & ~mask]
    assert unusual == [], unusual[:5]
