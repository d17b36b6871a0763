"""flows.sparse_eval.run_points: one row per (setting, sparsity) with the model's name, the measured
speed-up where asked for, and needle-retrieval accuracy beside the dense model's."""

from __future__ import annotations

import math
import os

import mlflow
import numpy as np

from flows.sparse_eval import run_points
from tasks.common.tracking import tracked_run
from tasks.sparse.registry import parse_settings
from tasks.sparse.retrieval import RetrievalConfig, build_retrieval_set
from test_retrieval import TEXTS, model, tok  # noqa: F401  (model and tok are test_retrieval's fixtures)


def test_run_points_rows_speed_and_retrieval(model, tok):  # noqa: F811
    items = build_retrieval_set(tok, TEXTS, RetrievalConfig(lengths=(128,), depths=(0.2, 0.8), n_distractors=3))
    val = np.concatenate([np.asarray(tok.encode(t), dtype=np.int64) for t in TEXTS[:6]])[:1025]
    settings = parse_settings({"teal": {"method": "teal", "mode": "topk", "sparsities": [0.5]},
                               "quoka": {"method": "quoka", "chunk_size": 16, "min_keys": 2, "sparsities": [0.5, 0.8]}})
    uri = os.environ["MLFLOW_TRACKING_URI"]
    with tracked_run("test-sparse-eval", uri=uri) as parent:
        rows = run_points(model=model, model_name="tiny-llama", settings=settings, val=val, calib=val[:256],
                          base_row={"variant": "pretrained", "run": None, "n_params": 1, "tokens": None},
                          seq_len=128, batch_size=4, eval_tokens=1024, parent=parent.ref(), speed="attention",
                          items=items)
    assert [r["setting"] for r in rows] == ["teal@0.5", "quoka@0.5", "quoka@0.8"]
    assert all(r["model"] == "tiny-llama" and r["variant"] == "pretrained" for r in rows)
    by = {r["setting"]: r for r in rows}
    assert by["teal@0.5"]["speedup"] is None  # activation sparsity is not timed under speed: attention
    assert all(by[s]["speedup"] > 0 for s in ("quoka@0.5", "quoka@0.8"))
    assert len({r["dense_retrieval_acc"] for r in rows}) == 1
    assert all(0.0 <= r["retrieval_acc"] <= 1.0 for r in rows)
    assert by["quoka@0.8"]["achieved_sparsity"] > by["quoka@0.5"]["achieved_sparsity"]
    assert all(math.isclose(r["ppl"], math.exp(r["val_loss"])) for r in rows)
    client = mlflow.MlflowClient(uri)
    logged = client.search_runs([client.get_run(parent.ref().run_id).info.experiment_id],
                                f"tags.mlflow.parentRunId = '{parent.ref().run_id}'")
    assert {r.data.metrics.get("retrieval_acc") is not None for r in logged} == {True}
    assert sorted(r.data.metrics.get("speedup") is not None for r in logged) == [False, True, True]
