"""The train stage's fan-out on a local 2-worker Ray cluster through prefect-ray."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import mlflow
import numpy as np
import pytest
from prefect import flow

from flows.runtime import PipelineConfig, make_context, task_runner
from flows.train import run_ladder, size_jobs
from tasks.common.io import write_json
from tasks.common.tracking import tracked_run
from tasks.training.config import ModelShape, TrainingConfig
from tasks.training.loop import ladder
from tasks.training.tokenizer import save_tokens

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.ray
def test_train_ladder_runs_on_two_ray_workers(prefect_harness, tmp_path: Path):
    pytest.importorskip("prefect_ray")
    rng = np.random.default_rng(0)
    save_tokens(tmp_path / "train.npy", rng.integers(0, 300, 20_000).astype(np.uint16))
    save_tokens(tmp_path / "val.npy", rng.integers(0, 300, 2_000).astype(np.uint16))
    save_tokens(tmp_path / "val.sources.npy", (np.arange(2_000) % 2).astype(np.int16))
    write_json(tmp_path / "val.meta.json", {"sources": ["a", "b"]})
    cfg = TrainingConfig(
        vocab_size=300, seq_len=32, batch_size=4,
        sizes=(ModelShape(d_model=32, n_layers=1, n_heads=2), ModelShape(d_model=16, n_layers=1, n_heads=2)),
        token_budgets=(2_048, 4_096), eval_interval=8, eval_tokens=512, checkpoint_interval=0,
        schedule="wsd", warmup_steps=2,
    )
    ctx = make_context(ROOT, preset="ci", workdir=tmp_path)
    ctx = dataclasses.replace(ctx, pipeline=dataclasses.replace(ctx.pipeline, runner="ray", ray_address=None, ray_num_cpus=2))
    runner = task_runner(ctx.pipeline)
    assert type(runner).__name__ == "RayTaskRunner"
    jobs = [
        dict(variant="v", specs=group, train_path=str(tmp_path / "train.npy"), val_path=str(tmp_path / "val.npy"),
             val_groups_path=str(tmp_path / "val.sources.npy"),
             out_dirs=[str(tmp_path / "models" / spec.name) for spec in group],
             stable_dir=str(tmp_path / "models" / f"stable-{group[0].size}"))
        for group in size_jobs(cfg, ladder(cfg))
    ]
    @flow
    def ladder_on_ray() -> list[dict]:
        with tracked_run("train", uri=ctx.tracking_uri, experiment="ray-test") as parent:
            return run_ladder(ctx, cfg, jobs, parent.ref()), parent.run_id

    rows, parent_id = ladder_on_ray()
    assert sorted(r["tokens"] for r in rows) == [2_048, 2_048, 4_096, 4_096]
    assert all(np.isfinite(r["val_loss"]) for r in rows)
    # Children were created inside Ray worker processes, linked to the parent by id.
    client = mlflow.MlflowClient(ctx.tracking_uri)
    exp = client.get_experiment_by_name("ray-test")
    children = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'")
    assert len(children) == 4 and {c.info.status for c in children} == {"FINISHED"}


@pytest.mark.slow
@pytest.mark.ray
def test_point_on_two_ray_train_workers(prefect_harness, tmp_path: Path):
    """training.workers_per_point: 2 under runner: ray: the point is Ray Train's TorchTrainer with 2
    gloo workers, launched from the Prefect task; rank 0's metrics land in the point's MLflow run,
    and the loss equals the same point trained by the plain loop."""
    pytest.importorskip("ray.train.torch")
    rng = np.random.default_rng(0)
    save_tokens(tmp_path / "train.npy", rng.integers(0, 300, 20_000).astype(np.uint16))
    save_tokens(tmp_path / "val.npy", rng.integers(0, 300, 2_000).astype(np.uint16))
    save_tokens(tmp_path / "val.sources.npy", (np.arange(2_000) % 2).astype(np.int16))
    write_json(tmp_path / "val.meta.json", {"sources": ["a", "b"]})
    cfg = TrainingConfig(vocab_size=300, seq_len=32, batch_size=2, grad_accum=2,
                         sizes=(ModelShape(d_model=32, n_layers=1, n_heads=2),), token_budgets=(2_048,),
                         eval_interval=8, eval_tokens=512, log_interval=4, checkpoint_interval=0, num_threads=1,
                         workers_per_point=2)
    ctx = make_context(ROOT, preset="ci", workdir=tmp_path)
    # the Prefect task holds one CPU while its two Ray Train workers hold one each
    ctx = dataclasses.replace(ctx, pipeline=dataclasses.replace(ctx.pipeline, runner="ray", ray_address=None,
                                                                ray_num_cpus=3))
    spec = ladder(cfg)[0]
    jobs = [dict(variant="v", specs=[spec], train_path=str(tmp_path / "train.npy"), val_path=str(tmp_path / "val.npy"),
                 val_groups_path=str(tmp_path / "val.sources.npy"), out_dirs=[str(tmp_path / "ray" / spec.name)],
                 stable_dir=None)]

    @flow
    def point_on_ray() -> list[dict]:
        with tracked_run("train", uri=ctx.tracking_uri, experiment="ray-train-test") as parent:
            return run_ladder(ctx, cfg, jobs, parent.ref()), parent.run_id

    rows, parent_id = point_on_ray()
    from tasks.training.loop import train_model
    from tasks.training.tokenizer import load_tokens

    one = dataclasses.replace(cfg, workers_per_point=1)
    plain = train_model(spec, one, load_tokens(tmp_path / "train.npy"), load_tokens(tmp_path / "val.npy"),
                        tmp_path / "plain")
    (row,) = rows
    assert row["devices"] == 2
    assert row["val_loss"] == pytest.approx(plain.val_loss, rel=1e-12, abs=0)
    client = mlflow.MlflowClient(ctx.tracking_uri)
    exp = client.get_experiment_by_name("ray-train-test")
    (child,) = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'")
    assert child.info.status == "FINISHED"
    curve = client.get_metric_history(child.info.run_id, "train_loss")
    assert [m.step for m in curve] == [h[0] for h in plain.history]  # rank 0's reports, once each
