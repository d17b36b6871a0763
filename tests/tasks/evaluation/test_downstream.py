"""The per-model driver: every task of a model scored, items that do not fit skipped, bad input named."""

from __future__ import annotations

import pytest

from tasks.evaluation.downstream import evaluate_tasks
from tests.tasks.evaluation.olmo_support import needs_olmo_eval


@needs_olmo_eval
def test_bad_input_is_named(neox, model):
    with pytest.raises(ValueError, match="limit: must be >= 1"):
        evaluate_tasks(model, neox, ["arc_easy"], limit=0)


@needs_olmo_eval
def test_evaluate_tasks_skips_items_that_do_not_fit_the_window(neox, model):
    (run,) = evaluate_tasks(model, neox, ["hellaswag"], limit=20, model_ctx_len=24)
    assert run.skipped and run.summary["n_items"] == 20 - len(run.skipped)
    assert run.summary["n_items"] == len(run.results) and run.n_available >= 20


def test_smollm2_artifacts_choose_the_compress_stage_rows_scored():
    from pathlib import Path

    from tasks.common.params import load_stage_config
    from tasks.evaluation.config import EvaluateConfig, SmolLM2EvalConfig

    every, some, none = (SmolLM2EvalConfig(artifacts=a) for a in (("*",), ("anybcq_*@w3", "rtn_w3_g128"), ()))
    rows = ["rtn_w3_g128", "rtn_w2_g128", "anybcq_g128_i2@w2", "anybcq_g128_i2@w3", "nubitq_b3.25"]
    assert [r for r in rows if every.scores_artifact(r)] == rows
    assert [r for r in rows if some.scores_artifact(r)] == ["rtn_w3_g128", "anybcq_g128_i2@w3"]
    assert not any(none.scores_artifact(r) for r in rows)
    root = Path(__file__).resolve().parents[3]
    demo, full = (load_stage_config(EvaluateConfig, root, "evaluate", p).smollm2 for p in ("demo", "full"))
    assert demo.artifacts == () and full.artifacts == ("*",)  # the demo's 20 items per task could not rank them
