"""The train flow on a tiny ladder: per-document validation losses for every run and seed, and
extra-seed runs reported beside train.csv, never in it."""

from __future__ import annotations

import shutil
from pathlib import Path

import polars as pl
import pytest
import yaml

from tasks.training.loop import read_doc_losses
from tests.flows.tiny_corpus import word_salad, write_workdir

ROOT = Path(__file__).resolve().parents[2]
TINY = {  # two sizes x two budgets, WSD; raw and a second variant; one extra seed on the larger size
    "vocab_size": 300, "seq_len": 32, "batch_size": 4, "warmup_steps": 1, "eval_interval": 8, "eval_tokens": 256,
    "log_interval": 4, "checkpoint_interval": 0, "schedule": "wsd", "compute_budgets": [],
    "token_budgets": [1024, 2048], "sizes": [{"d_model": 16, "n_layers": 1, "n_heads": 2},
                                            {"d_model": 32, "n_layers": 1, "n_heads": 2}],
    "variants": ["raw", "other"], "repb": {"compare": []}, "seeds": [1], "seed_sizes": ["d32_l1"],
}


def set_ci_preset(root: Path, preset: dict) -> None:
    params = yaml.safe_load((root / "params" / "training.yaml").read_text())
    params["presets"]["ci"] = preset
    (root / "params" / "training.yaml").write_text(yaml.safe_dump(params))


def tiny_root(tmp_path: Path, preset: dict = TINY) -> tuple[Path, Path]:
    """A project root whose `ci` training preset is ``preset``, and a workdir with prepared and curated text."""
    root = tmp_path / "root"
    shutil.copytree(ROOT / "params", root / "params")
    set_ci_preset(root, preset)
    docs = word_salad(300, (20, 80))
    work = tmp_path / "work"
    write_workdir(work, docs, {"raw": docs[:260], "other": docs[:200]})
    return root, work


def test_train_flow_writes_doc_losses_per_seed_and_keeps_seeds_out_of_train_csv(prefect_harness, tmp_path):
    from flows.train import train_flow

    root, work = tiny_root(tmp_path)
    train_flow(root=str(root), preset="ci", workdir=str(work))
    reports = work / "reports"
    train = pl.read_csv(reports / "train.csv")
    assert len(train) == 2 * 4 and set(train["seed"]) == {0}  # 2 variants x 4 points, base seed only
    assert (train["val_tokens"] > 0).all()

    docs = pl.read_parquet(reports / "val_docs.parquet")
    assert docs.columns == ["variant", "data_variant", "run", "seed", "n_params_total", "tokens_trained",
                            "compute_budget", "doc", "source", "tokens", "loss_sum"]
    # every run's documents sum to its full-split val_loss
    per_run = docs.group_by("variant", "run", "seed").agg((pl.col("loss_sum").sum() / pl.col("tokens").sum()).alias("mean"),
                                                         pl.col("tokens").sum().alias("n"))
    joined = train.join(per_run.filter(pl.col("seed") == 0), on=["variant", "run"])
    assert len(joined) == len(train)
    assert (joined["val_loss"] - joined["mean"]).abs().max() < 1e-9 and (joined["val_tokens"] == joined["n"]).all()
    # the source of each document is the val split's, by row
    sources = pl.read_parquet(work / "data" / "prepared" / "val.parquet")["source"]
    assert all(sources[d] == s for d, s in docs.select("doc", "source").unique().iter_rows())
    assert read_doc_losses(Path(work) / train["model_dir"][0]).height > 0

    # the extra seed: the seeded size's 2 points per variant, in train_seeds.csv and val_docs.parquet only
    seeds = pl.read_csv(reports / "train_seeds.csv")
    assert seeds.columns == train.columns
    assert sorted(seeds.select("variant", "run", "seed").rows()) == sorted(
        (v, f"d32_l1_D{d}", 1) for v in ("raw", "other") for d in (1024, 2048))
    assert set(seeds["model_dir"]).isdisjoint(train["model_dir"])  # folders of their own
    assert set(docs.filter(pl.col("run").str.starts_with("d32_l1")).select("variant", "seed").unique().rows()) == {
        ("raw", 0), ("raw", 1), ("other", 0), ("other", 1)}
    assert set(docs.filter(pl.col("run").str.starts_with("d16_l1"))["seed"]) == {0}
    both = (docs.filter(pl.col("run") == "d32_l1_D2048", pl.col("variant") == "raw")
            .pivot(on="seed", index="doc", values="loss_sum"))
    assert both.height > 0 and (both["0"] != both["1"]).any()  # another init and data order, the same documents
    # a rerun trains nothing, keeps every folder (extra-seed ones too) and writes the same tables
    train_flow(root=str(root), preset="ci", workdir=str(work))
    assert all((work / d).is_dir() for d in [*train["model_dir"], *seeds["model_dir"]])
    assert pl.read_csv(reports / "train_seeds.csv").equals(seeds)
    assert pl.read_parquet(reports / "val_docs.parquet").equals(docs)


def test_extra_branches_and_an_arch_arm_add_series_rows_and_leave_the_ladder_in_place(prefect_harness, tmp_path):
    """``extra_branches: [0.5]`` adds one anneal point per size (0.5 x 2048 is the ladder's 1024: skipped);
    ``arch_compare: [raw]`` trains ``raw+xlstm`` on the same points; the ladder trained before keeps its
    folders and numbers, and the fit stage's decisions compare ``raw+xlstm`` against ``raw``."""
    from flows.fit import gather_points, run_decisions
    from flows.train import train_flow
    from tasks.scaling.config import DecisionConfig, FitConfig

    plain = TINY | {"variants": ["raw"], "seeds": [], "seed_sizes": []}
    root, work = tiny_root(tmp_path, plain)
    train_flow(root=str(root), preset="ci", workdir=str(work))
    reports = work / "reports"
    before = pl.read_csv(reports / "train.csv")
    assert before["point"].to_list() == ["ladder"] * 4

    set_ci_preset(root, plain | {"extra_branches": [0.5], "arch_compare": ["raw"]})
    train_flow(root=str(root), preset="ci", workdir=str(work))
    train = pl.read_csv(reports / "train.csv")
    cols = ["run", "model_dir", "steps", "val_loss"]
    again = train.filter(pl.col("variant") == "raw", pl.col("point") == "ladder")
    assert again.select(cols).sort("run").equals(before.select(cols).sort("run"))  # same folders, same numbers
    runs = sorted(["d16_l1_D1024", "d16_l1_D2048", "d32_l1_D1024", "d32_l1_D2048", "d16_l1_D512", "d32_l1_D512"])
    for series, arch in (("raw", "llama"), ("raw+xlstm", "xlstm")):
        rows = train.filter(pl.col("variant") == series)
        assert sorted(rows["run"]) == runs and set(rows["arch"]) == {arch} and set(rows["data_variant"]) == {"raw"}
        anneal = rows.filter(pl.col("point") == "anneal")
        assert sorted(anneal["run"]) == ["d16_l1_D512", "d32_l1_D512"] and set(anneal["steps"]) == {4}
    pair = train.pivot(on="variant", index="run", values="steps")
    assert (pair["raw"] == pair["raw+xlstm"]).all()  # equal steps, run by run
    xl = train.filter(pl.col("variant") == "raw+xlstm")
    assert set(xl["model_dir"]).isdisjoint(train.filter(pl.col("variant") == "raw")["model_dir"])
    assert (xl.sort("run")["n_params_total"] != train.filter(pl.col("variant") == "raw").sort("run")["n_params_total"]).all()

    docs = pl.read_parquet(reports / "val_docs.parquet")
    assert sorted(docs.filter(pl.col("variant") == "raw+xlstm")["run"].unique()) == runs
    per = docs.group_by("variant", "run").agg(pl.len().alias("n"))
    assert per["n"].n_unique() == 1  # every run of both series scored the same documents

    points = gather_points(reports).points
    assert set(points.filter(pl.col("point") == "anneal")["run"]) == {"d16_l1_D512", "d32_l1_D512"}
    fit_cfg = FitConfig(decisions=DecisionConfig(n_bootstrap=100, fit_bootstrap=0, nested_bootstrap=0, grid_steps=9,
                                                 per_source=False, downstream_bpb=False))
    out = run_decisions(reports, points, fit_cfg)
    observed = [r for r in out["rows"] if r["kind"] == "observed" and r["variant"] == "raw+xlstm"]
    assert {r["run"] for r in observed if r["comparison"] == "same_size"} == set(runs)
    # per-budget "best" comparisons see the ladder's token budgets only, not the anneal points'
    assert {r["budget"] for r in observed if r["comparison"] == "best"} == {1024.0, 2048.0}
