"""flows.sparse_eval: a pretrained model (a tiny Llama standing in for SmolLM2) scored on whole windows."""

from __future__ import annotations

import math
import os

import pytest

from tasks.common.tracking import tracked_run
from tasks.sparse.registry import SparseEvalConfig

SETTINGS = {"quoka": {"method": "quoka", "chunk_size": 16, "min_keys": 2, "sparsities": [0.5]}}


def test_pretrained_eval_tokens_of_one_window_score_that_window(smollm2_stand_in):
    """``pretrained_eval_tokens == pretrained_seq_len`` (the demo's SmolLM2: one window of 1024) is one
    whole window of predictions: the prepared text gives one token more, for the last target."""
    from flows.sparse_eval import sparse_eval_pretrained

    cfg = SparseEvalConfig(settings=SETTINGS, pretrained=("smollm2",), pretrained_eval_tokens=128,
                           pretrained_seq_len=128, calib_tokens=256, speed="none")
    with tracked_run("test-sparse-eval-pretrained", uri=os.environ["MLFLOW_TRACKING_URI"]) as parent:
        rows = sparse_eval_pretrained.fn("smollm2", cfg, str(smollm2_stand_in), parent.ref())
    assert [r["setting"] for r in rows] == ["quoka@0.5"]
    assert rows[0]["model"] == "smollm2-135m" and math.isfinite(rows[0]["ppl"])


def test_pretrained_eval_tokens_below_one_window_are_refused():
    with pytest.raises(ValueError, match="pretrained_eval_tokens: scores whole windows"):
        SparseEvalConfig(settings=SETTINGS, pretrained_eval_tokens=512, pretrained_seq_len=1024)
