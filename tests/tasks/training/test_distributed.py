"""One point across 2 CPU workers (gloo): the same loss curve as one process, FSDP = DDP, a killed
worker resumes to the uninterrupted final loss, and bad scale-outs are refused before any work.

Tolerance: DDP at W = 2 averages two micro-batch gradients by an all-reduce instead of summing
halves in one process; halving is exact in binary floating point, so the curves agree to float64
print precision here; FSDP's gradient-norm reduction sums per-shard squares in another order, so
FSDP is held to a relative 1e-5 of DDP's losses.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch.distributed as dist
from training_fixtures import markov_tokens, tiny_config

from tasks.training.config import RePBConfig
from tasks.training.distributed import PointJob, WorkerFailed, check_parallel, train_points
from tasks.training.loop import train_model
from tasks.training.design import ladder
from tasks.training.checkpoint import checkpoint_files, load_checkpoint
from tasks.training.tokenizer import save_tokens

REL_TOL_FSDP = 1e-5


def two_worker_config(**changes):
    """16 steps of a global batch of 4 sequences: 2 micro-batches of 2, one per worker at W = 2."""
    return tiny_config(**{**dict(token_budgets=(2048,), batch_size=2, grad_accum=2, eval_interval=8, log_interval=2,
                                 checkpoint_interval=4, lr=1e-2), **changes})


@pytest.fixture(scope="module")
def token_files(tmp_path_factory):
    data = markov_tokens(60_000)
    root = tmp_path_factory.mktemp("tokens")
    return str(save_tokens(root / "train.npy", data[:50_000])), str(save_tokens(root / "val.npy", data[50_000:]))


def job_for(cfg, token_files, out) -> PointJob:
    spec = ladder(cfg)[0]
    return PointJob(specs=[spec], cfg=cfg, train_path=token_files[0], val_path=token_files[1], out_dirs=[str(out)])


@pytest.fixture(scope="module")
def one_worker(token_files, tmp_path_factory):
    """The reference: the plain one-process loop at the same global batch."""
    out = tmp_path_factory.mktemp("w1") / "run"
    return train_points(job_for(two_worker_config(), token_files, out))[0]


@pytest.fixture(scope="module")
def ddp_two(token_files, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp2") / "run"
    logged = []
    results = train_points(job_for(two_worker_config(workers_per_point=2), token_files, out),
                           on_metrics=lambda spec: lambda m, step: logged.append((step, m)))
    return results[0], out, logged


def test_two_ddp_workers_give_the_one_worker_loss_curve(one_worker, ddp_two):
    two, out, logged = ddp_two
    assert two.steps == one_worker.steps == 16 and two.devices == 2 and one_worker.devices == 1
    assert [h[0] for h in two.history] == [h[0] for h in one_worker.history]
    for (_, a_train, a_val), (_, b_train, b_val) in zip(two.history, one_worker.history):
        assert a_train == pytest.approx(b_train, rel=1e-12, abs=0)
        assert (a_val is None) == (b_val is None)
        if a_val is not None:
            assert a_val == pytest.approx(b_val, rel=1e-12, abs=0)
    assert two.val_loss == pytest.approx(one_worker.val_loss, rel=1e-12, abs=0)
    assert two.val_loss < 5.2  # it learned (log(256) = 5.55 at the start)
    # the accounting counts every worker's tokens; rank 0 alone reported, once per log step
    assert two.tokens == one_worker.tokens and two.flops_total == one_worker.flops_total
    assert two.tokens_per_s > 0 and two.wall_s > 0
    assert [step for step, _ in logged] == [h[0] for h in two.history]
    assert (out / "model.safetensors").exists() and (out / "result.json").exists()
    assert not (out / "checkpoint").exists()


def test_fsdp_gives_the_ddp_result(ddp_two, token_files, tmp_path):
    ddp, _, _ = ddp_two
    out = tmp_path / "run"
    fsdp = train_points(job_for(two_worker_config(workers_per_point=2, parallel="fsdp"), token_files, out))[0]
    for (_, a, _), (_, b, _) in zip(fsdp.history, ddp.history):
        assert a == pytest.approx(b, rel=REL_TOL_FSDP)
    assert fsdp.val_loss == pytest.approx(ddp.val_loss, rel=REL_TOL_FSDP)
    # the gathered full weights load into a plain model: the same file format as one process writes
    from tasks.zoo.ladder import load_model

    model, meta = load_model(out)
    assert meta["result"]["devices"] == 2 and sum(p.numel() for p in model.parameters()) > 0


def test_killed_worker_resumes_to_the_uninterrupted_loss(ddp_two, token_files, tmp_path, monkeypatch):
    """Rank 0 is killed while writing its second checkpoint (step 8: tensors written, record not);
    the launcher ends the other worker, and the rerun resumes both from step 4."""
    reference, _, _ = ddp_two
    cfg = two_worker_config(workers_per_point=2)
    out = tmp_path / "run"
    monkeypatch.setenv("SCALELAB_FAULT", "train.checkpoint@2")
    with pytest.raises(WorkerFailed, match=r"worker 0 of 2 was killed by signal 9"):
        train_points(job_for(cfg, token_files, out))
    monkeypatch.delenv("SCALELAB_FAULT")
    assert [s for s, _, _ in checkpoint_files(out / "checkpoint")] == [4]
    assert not (out / "result.json").exists()
    steps = []
    resumed = train_points(job_for(cfg, token_files, out), progress=lambda spec: lambda s, n: steps.append(s))[0]
    assert steps[0] == 5
    assert resumed.val_loss == reference.val_loss  # bit-identical on CPU
    assert resumed.history == reference.history


@pytest.mark.slow
def test_ddp_checkpoint_is_the_one_process_format(token_files, tmp_path, monkeypatch):
    """A DDP run interrupted at W = 2 resumes in one process (rank 0 wrote the replicated state)."""
    cfg = two_worker_config(workers_per_point=2)
    out = tmp_path / "run"
    monkeypatch.setenv("SCALELAB_FAULT", "train.checkpoint@3")
    with pytest.raises(WorkerFailed):
        train_points(job_for(cfg, token_files, out))
    monkeypatch.delenv("SCALELAB_FAULT")
    (step, path, _), = checkpoint_files(out / "checkpoint")
    assert step == 8 and path.suffix == ".safetensors"
    steps = []
    from tasks.training.tokenizer import load_tokens

    one = dataclasses.replace(cfg, workers_per_point=1)
    result = train_model(ladder(one)[0], one, load_tokens(token_files[0]), load_tokens(token_files[1]), out,
                         progress=lambda s, n: steps.append(s))
    assert steps[0] == 9 and math.isfinite(result.val_loss)


@pytest.mark.slow
def test_fsdp_killed_run_resumes_from_its_sharded_checkpoint(token_files, tmp_path, monkeypatch):
    cfg = two_worker_config(workers_per_point=2, parallel="fsdp")
    reference = train_points(job_for(cfg, token_files, tmp_path / "reference"))[0]
    out = tmp_path / "run"
    monkeypatch.setenv("SCALELAB_FAULT", "train.checkpoint@2")
    with pytest.raises(WorkerFailed):
        train_points(job_for(cfg, token_files, out))
    monkeypatch.delenv("SCALELAB_FAULT")
    files = checkpoint_files(out / "checkpoint")
    assert [s for s, _, _ in files] == [4] and files[0][1].suffix == ".dcp"
    with pytest.raises(ValueError, match=r"parallel: fsdp"):  # a plain loop refuses the shards by name
        load_checkpoint(out / "checkpoint", None, None)
    resumed = train_points(job_for(cfg, token_files, out))[0]
    assert resumed.val_loss == reference.val_loss
    assert resumed.history == reference.history


@pytest.mark.slow
def test_wsd_size_on_two_workers_matches_one(token_files, tmp_path):
    """A WSD size (stable run + a cooldown branch per budget) at W = 2 against W = 1."""
    cfg = two_worker_config(token_budgets=(1024, 2048), schedule="wsd", warmup_steps=2)
    specs = ladder(cfg)

    def run(c, name):
        job = PointJob(specs=specs, cfg=c, train_path=token_files[0], val_path=token_files[1],
                       out_dirs=[str(tmp_path / name / s.name) for s in specs], stable_dir=str(tmp_path / name / "stable"))
        return train_points(job)

    one = run(cfg, "w1")
    two = run(dataclasses.replace(cfg, workers_per_point=2), "w2")
    for a, b in zip(one, two):
        assert b.val_loss == pytest.approx(a.val_loss, rel=1e-12, abs=0)
        assert b.shared_steps == a.shared_steps > 0


# --------------------------------------------------------------------------------------------
# Refused before any work


def test_global_batch_not_divisible_by_workers_is_refused():
    with pytest.raises(ValueError, match=r"workers_per_point: the global batch of batch_size x grad_accum = 4 x 1"):
        tiny_config(workers_per_point=2)
    with pytest.raises(ValueError, match=r"workers_per_point: .*RePB"):
        tiny_config(grad_accum=2, workers_per_point=2, repb=RePBConfig(compare=("raw",)))
    with pytest.raises(ValueError, match=r"gpus_per_worker: must be 0"):
        tiny_config(gpus_per_worker=2)
    with pytest.raises(ValueError, match=r"parallel: must be 'ddp' or 'fsdp'"):
        tiny_config(parallel="tp")


def test_more_gpu_workers_than_devices_is_refused(monkeypatch):
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    cfg = tiny_config(grad_accum=4, workers_per_point=4, gpus_per_worker=1)
    with pytest.raises(ValueError, match=r"workers_per_point: 4 workers x gpus_per_worker 1 need 4 GPUs, "
                                         r"this machine has 2"):
        check_parallel(cfg, cuda_devices=2)
    check_parallel(cfg, cuda_devices=4)
    check_parallel(cfg, launcher="ray", cuda_devices=0)  # the Ray cluster's GPUs are counted at placement


@pytest.mark.skipif(dist.is_nccl_available(), reason="this torch build has NCCL")
def test_gpu_fsdp_on_a_build_without_nccl_is_refused(token_files, tmp_path):
    cfg = tiny_config(grad_accum=2, workers_per_point=2, gpus_per_worker=1, parallel="fsdp")
    with pytest.raises(ValueError, match=r"parallel: fsdp with gpus_per_worker: 1 needs an FSDP-sharded point "
                                         r"over nccl, which this torch build cannot do"):
        train_points(job_for(cfg, token_files, tmp_path / "run"))
    assert not (tmp_path / "run").exists()  # refused before any work
