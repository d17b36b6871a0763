"""One unit failing never sinks the others: a model made to fail in compress, prune, sparse_eval and
evaluate leaves the other model's rows complete, is listed in reports/failures/ with a FAILED MLflow
run, and `scalelab run all` exits non-zero with the failure first in the summary. A stage whose every
unit fails, or a config error inside a unit, still stops the stage. A Prefect flow run a killed
process left RUNNING is marked CRASHED by the next command on the workdir.

Everything runs on a two-model ladder trained once per module (seconds), not on the ci pipeline.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import mlflow
import polars as pl
import pytest
import yaml

from tasks.common.tracking import tracking_uri
from tests.flows.tiny_corpus import word_salad, write_workdir

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 300
# Two 2-layer models (a layer can be pruned), one budget, one variant; each stage narrowed to seconds.
PRESETS = {
    "training": {"vocab_size": VOCAB, "seq_len": 32, "batch_size": 4, "warmup_steps": 1, "eval_interval": 8,
                 "eval_tokens": 256, "log_interval": 4, "checkpoint_interval": 0, "schedule": "cosine",
                 "compute_budgets": [], "token_budgets": [2048],
                 "sizes": [{"d_model": 16, "n_layers": 2, "n_heads": 2}, {"d_model": 32, "n_layers": 2, "n_heads": 2}],
                 "variants": ["raw"], "repb": {"compare": []}, "seeds": [], "seed_sizes": [], "arch_compare": [],
                 "extra_branches": []},
    "compression": {"variants": [], "enabled": ["rtn_w4_g32"], "eval_tokens": 512, "calib_tokens": 0, "pretrained": []},
    "pruning": {"variants": [], "largest_only": False, "enabled": ["cosine_l1"], "calib_tokens": 256, "eval_tokens": 512,
                "settings": {"cosine_l1": {"method": "cosine_drop", "n_remove": 1, "granularity": "layer", "seq_len": 32,
                                           "calib_windows": 2}},
                "recovery": {"losses": ["csd"], "data_select": ["random"], "compare_settings": [], "budget": 1.0,
                             "steps": 1, "tokens": 512, "seq_len": 32, "batch_size": 2, "curve_every": 1},
                "save": {"ladder": "none"}, "pretrained": []},
    "sparse_eval": {"variants": [], "enabled": ["teal"], "pretrained": [], "settings": {"teal": {"sparsities": [0.5]}},
                    "eval_tokens": 512, "calib_tokens": 256, "speed": "none"},
    "evaluate": {"tasks": ["arc_easy"], "limit": 4, "variants": [], "compressed": False, "pruned": False, "sparse": {},
                 "variant_top": 1, "smollm2": {"enabled": False}, "task_laws": {"n_bootstrap": 5},
                 "microbench": {"enabled": False}},
}
# Per stage: its table, the function each unit loads its model with (patched to fail one), a metric
# every finished row has.
STAGES = {
    "compress": ("compress.csv", "flows.compress.load_model", "val_loss"),
    "prune": ("pruning.csv", "flows.prune.load_model", "ppl"),
    "sparse_eval": ("sparse_eval.csv", "flows.sparse_eval.load_model", "val_loss"),
    "evaluate": ("downstream.csv", "flows.evaluate.load_causal_lm", "acc"),
}


def tiny_root(tmp: Path) -> tuple[Path, Path]:
    """A project root whose `ci` presets are :data:`PRESETS`, and a workdir with prepared and curated text."""
    root = tmp / "root"
    shutil.copytree(ROOT / "params", root / "params")
    for stage, preset in PRESETS.items():
        path = root / "params" / f"{stage}.yaml"
        params = yaml.safe_load(path.read_text())
        params["presets"]["ci"] = preset
        path.write_text(yaml.safe_dump(params))
    docs = word_salad(300, (20, 80))
    work = tmp / "work"
    write_workdir(work, docs, {"raw": docs[:260]})
    return root, work


@pytest.fixture(scope="module")
def ladder(prefect_harness, tmp_path_factory):
    """``(root, workdir, runs)``: the two trained models' run names, smallest first."""
    from flows.train import train_flow

    root, work = tiny_root(tmp_path_factory.mktemp("unit-failures"))
    train_flow(root=str(root), preset="ci", workdir=str(work))
    train = pl.read_csv(work / "reports" / "train.csv").sort("n_params")
    assert train.height == 2 and (train["status"] == "ok").all()
    return root, work, train["run"].to_list()


def fail_model(monkeypatch, target: str, runs: list[str], error: type[Exception] = RuntimeError) -> None:
    """Make the model folders of ``runs`` fail to load in ``target`` (``module.function``)."""
    module, _, name = target.rpartition(".")
    original = getattr(__import__(module, fromlist=[name]), name)

    def load(path, *args, **kwargs):
        if Path(str(path)).name.rsplit("-", 1)[0] in runs:  # folder <run>-<config hash>
            raise error(f"injected failure loading {Path(str(path)).name}")
        return original(path, *args, **kwargs)

    monkeypatch.setattr(target, load)


def stage_flow(stage: str):
    from flows.pipeline import STAGE_FLOWS

    return STAGE_FLOWS[stage]


def runs_of(work: Path, query: str):
    client = mlflow.MlflowClient(tracking_uri(work))
    exp = client.get_experiment_by_name("scalelab")
    return client.search_runs([exp.experiment_id], f"tags.`scalelab.workdir` = '{work}' and {query}",
                              order_by=["attributes.start_time DESC"])


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_failing_unit_leaves_the_other_units_rows_complete(ladder, stage, monkeypatch):
    root, work, runs = ladder
    table, loader, metric = STAGES[stage]
    bad, good = runs
    fail_model(monkeypatch, loader, [bad])
    stage_flow(stage)(root=str(root), preset="ci", workdir=str(work))

    rows = pl.read_csv(work / "reports" / table, infer_schema_length=None)
    failed, ok = rows.filter(pl.col("run") == bad), rows.filter(pl.col("run") == good)
    assert failed.height >= 1 and (failed["status"] == "failed").all()
    assert failed["error"].str.contains("RuntimeError: injected failure").all()
    assert failed[metric].is_null().all()  # a missing score stays missing, never 0
    assert ok.height >= 1 and (ok["status"] == "ok").all() and ok["error"].is_null().all()
    assert ok[metric].is_not_null().all()
    if stage != "evaluate":  # evaluate's failed unit keeps one row per task under its base model
        assert set(failed["setting"]) <= set(ok["setting"])  # the failed unit's rows name the same settings

    failures = pl.read_csv(work / "reports" / "failures" / f"{stage}.csv")
    assert failures.select("stage", "unit", "error_type").rows() == [(stage, f"raw/{bad}", "RuntimeError")]
    assert "Traceback" in (work / "reports" / "failures" / f"{stage}.log").read_text()
    (unit_run,) = runs_of(work, f"attributes.run_name = '{stage}:raw/{bad}'")[:1]
    assert unit_run.info.run_id == failures["mlflow_run_id"][0]
    assert unit_run.info.status == "FAILED" and "injected failure" in unit_run.data.tags["error"]
    stage_run = runs_of(work, f"attributes.run_name = '{stage}'")[0]
    assert stage_run.info.status == "FINISHED" and unit_run.data.tags["mlflow.parentRunId"] == stage_run.info.run_id
    assert stage_run.data.metrics["units_failed"] == 1 and stage_run.data.metrics["units"] == 2
    if stage == "prune":  # prune publishes its table as a Prefect artifact, as every stage does
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

        with get_client(sync_client=True) as client:
            arts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["prune-ci"])))
        assert any(stage_run.info.run_id in (a.description or "") for a in arts)


def test_a_rerun_that_fails_nothing_clears_the_failures(ladder):
    root, work, _ = ladder
    stage_flow("sparse_eval")(root=str(root), preset="ci", workdir=str(work))
    assert pl.read_csv(work / "reports" / "failures" / "sparse_eval.csv").height == 0
    assert (pl.read_csv(work / "reports" / "sparse_eval.csv")["status"] == "ok").all()


def test_run_all_exits_non_zero_and_the_summary_lists_failures_first(ladder, monkeypatch, capsys):
    from flows import cli, pipeline

    root, work, runs = ladder
    fail_model(monkeypatch, STAGES["compress"][1], [runs[0]])
    args = ["--preset", "ci", "--root", str(root), "--workdir", str(work)]
    # one stage alone (what dvc repro runs): exit 0, the failure named on stderr, later stages go on
    assert cli.main(["run", "compress", *args]) == 0
    assert f"compress: raw/{runs[0]} failed: RuntimeError" in capsys.readouterr().err
    # `run all` (here over compress only, on the trained workdir): every stage runs, then exit 1
    monkeypatch.setattr(pipeline, "STAGE_FLOWS", {"compress": pipeline.STAGE_FLOWS["compress"]})
    assert cli.main(["run", "all", *args]) == 1
    assert f"compress: raw/{runs[0]} failed" in capsys.readouterr().err
    summary = (work / "reports" / "summary.md").read_text()
    assert summary.startswith("# What this run found\n\n## Failures\n\n- compress: raw/" + runs[0])
    assert cli.main(["report", "--workdir", str(work)]) in (1, 2)  # 2 only for files this narrowed run never wrote


def test_every_unit_failing_fails_the_stage(ladder, monkeypatch):
    from flows.stage import StageFailed

    root, work, runs = ladder
    fail_model(monkeypatch, STAGES["compress"][1], runs)
    with pytest.raises(StageFailed, match=r"compress: every unit failed \(2\)"):
        stage_flow("compress")(root=str(root), preset="ci", workdir=str(work))
    assert runs_of(work, "attributes.run_name = 'compress'")[0].info.status == "FAILED"
    assert pl.read_csv(work / "reports" / "failures" / "compress.csv").height == 2


def test_a_config_error_inside_a_unit_is_not_isolated(ladder, monkeypatch):
    from tasks.common.config import ConfigError

    root, work, runs = ladder
    fail_model(monkeypatch, STAGES["sparse_eval"][1], [runs[0]], error=ConfigError)
    with pytest.raises(ConfigError, match="injected failure"):
        stage_flow("sparse_eval")(root=str(root), preset="ci", workdir=str(work))


def test_a_flow_run_left_running_by_a_killed_process_is_marked_crashed(prefect_harness, tmp_path):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.states import Running

    from flows.runtime import OWNER_FLOW_TAG, claim_workdir, make_context, workdir_flow_tag
    from tasks.common.tracking import owner_tags

    @flow(name="orphan-probe")
    def probe() -> None:
        pass

    ctx = make_context(ROOT, preset="ci", workdir=tmp_path / "work")
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid whose process has exited
    me = owner_tags()
    owners = {"dead": f"{OWNER_FLOW_TAG}{me['scalelab.owner.host']}:{gone.pid}:1",
              "alive": f"{OWNER_FLOW_TAG}{me['scalelab.owner.host']}:{me['scalelab.owner.pid']}:{me['scalelab.owner.start']}"}
    with get_client(sync_client=True) as client:
        ids = {}
        for who, owner in owners.items():
            fr = client.create_flow_run(probe, tags=[workdir_flow_tag(ctx.workdir), owner])
            client.set_flow_run_state(fr.id, Running(), force=True)
            ids[who] = fr.id
        other = client.create_flow_run(probe, tags=[workdir_flow_tag(tmp_path / "elsewhere"), owners["dead"]])
        client.set_flow_run_state(other.id, Running(), force=True)
        with claim_workdir(ctx):
            pass
        states = {who: client.read_flow_run(i).state for who, i in ids.items()}
        assert states["dead"].type.value == "CRASHED" and str(gone.pid) in states["dead"].message
        assert states["alive"].type.value == "RUNNING"  # this process: alive
        assert client.read_flow_run(other.id).state.type.value == "RUNNING"  # another workdir's: not ours


def test_a_failing_training_run_is_marked_and_later_stages_run_on_what_exists(ladder, tmp_path, monkeypatch):
    import flows.train
    import tasks.training.distributed

    root, work, (bad, good) = ladder
    work = Path(shutil.copytree(work, tmp_path / "work", ignore=shutil.ignore_patterns(".prefect")))
    original = tasks.training.distributed.train_model  # what a one-worker point runs

    def train_model(spec, *args, **kwargs):
        if spec.name == bad:
            raise FloatingPointError(f"injected: {spec.name} blew up")
        return original(spec, *args, **kwargs)

    monkeypatch.setattr(tasks.training.distributed, "train_model", train_model)
    flows.train.train_flow(root=str(root), preset="ci", workdir=str(work))
    train = pl.read_csv(work / "reports" / "train.csv")
    (row,) = train.filter(pl.col("run") == bad).to_dicts()
    assert row["status"] == "failed" and row["error"] == f"FloatingPointError: injected: {bad} blew up"
    assert row["val_loss"] is None and row["model_dir"] is None and row["n_params"] > 0
    assert train.filter(pl.col("run") == good)["status"].to_list() == ["ok"]
    assert pl.read_csv(work / "reports" / "failures" / "train.csv")["unit"].to_list() == [f"raw/{bad}"]
    # compress works on the model that exists; the failed run is no unit of it, failed or not
    stage_flow("compress")(root=str(root), preset="ci", workdir=str(work))
    compress = pl.read_csv(work / "reports" / "compress.csv")
    assert set(compress["run"]) == {good} and set(compress["status"]) == {"ok"}
