"""One ladder point across W worker processes: DDP or FSDP2, launched locally or by Ray Train.

``training.workers_per_point`` = W processes train one point together (``gpus_per_worker``: 0 =
CPU workers over gloo, 1 = one GPU each over nccl). The step is the one-process step, cut in W:

* the global batch stays ``batch_size x grad_accum`` sequences; rank ``r`` reads micro-batches
  ``r * grad_accum / W ... (r + 1) * grad_accum / W - 1`` of each step from the memory-mapped
  token file (:meth:`DataParallel.micro_batches`), the same samples a single process would read
  (:class:`tasks.training.loop.WindowSampler` draws them from ``(seed, step)`` alone);
* each rank scales its micro-batch losses by ``1 / (grad_accum / W)`` and the gradients are
  averaged over the W ranks once per step (DDP's all-reduce, FSDP2's reduce-scatter), which is the
  one-process gradient ``sum / grad_accum`` up to float summation order;
* the learning rate, clipping, WSD stable run, cooldown branches, evaluation and checkpoints follow
  the step counter as before, so a point's result does not depend on W (the tests bound the float
  difference).

``parallel: ddp`` replicates the weights (PyTorch DistributedDataParallel; Li et al., VLDB 2020);
rank 0 writes checkpoints in the one-process format, so a DDP run resumes on any W, or on one
process. ``parallel: fsdp`` shards weights, gradients and AdamW state over the ranks
(``torch.distributed.fsdp.fully_shard``, FSDP2; Zhao et al., VLDB 2023), per decoder layer and
then the root; its checkpoints are ``torch.distributed.checkpoint`` folders
(``state-<step>.dcp/``), written by every rank and readable at another W.

Launch (:func:`train_points`): W = 1 runs in the calling process (today's loop, unchanged). W > 1
starts W processes on this machine (``runner: local``; forkserver processes, a file store for the
rendezvous) or Ray Train's ``TorchTrainer`` with W workers (``runner: ray``). Only rank 0 reports:
its metrics, progress and results travel back over a queue to the caller, which logs them (one
MLflow run per point, written by the caller's process). A worker that dies ends the others; the
rerun resumes every rank from the newest complete checkpoint.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import queue as queue_lib
import signal
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from tasks.common.faults import fault_point
from tasks.common.io import read_json, write_json
from tasks.common.parallel import set_process_threads
from tasks.training.config import TrainingConfig
from tasks.training.loop import MetricsCallback, ProgressCallback, TrainResult, train_model, train_size_wsd
from tasks.training.design import RunSpec
from tasks.training.checkpoint import checkpoint_files, load_checkpoint, remove_older_checkpoints, save_checkpoint
from tasks.training.tokenizer import load_tokens


def backend_for(cfg: TrainingConfig) -> str:
    """The collective backend of a point's workers: nccl between GPUs, gloo between CPU processes."""
    return "nccl" if cfg.gpus_per_worker > 0 else "gloo"


def check_parallel(cfg: TrainingConfig, *, launcher: str = "local", cuda_devices: int | None = None) -> None:
    """Refuse a scale-out this machine (``launcher: local``) cannot run, before any work starts.

    ``ValueError`` naming the key: more GPU workers than visible CUDA devices (``cuda_devices``,
    default ``torch.cuda.device_count()``), or a backend missing from this torch build. Under
    ``runner: ray`` the GPU count is the cluster's, checked when the point's workers are placed.
    The batch arithmetic (``grad_accum`` a multiple of W) is :class:`TrainingConfig`'s own check.
    """
    w, g = cfg.workers_per_point, cfg.gpus_per_worker
    if w == 1 and g == 0:
        return
    if not dist.is_available():
        raise ValueError(f"training.workers_per_point: {w} workers need torch.distributed, which this torch "
                         "build lacks; set workers_per_point: 1")
    backend = backend_for(cfg)
    available = {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available()}[backend]
    if not available:
        what = ("an FSDP-sharded point" if cfg.parallel == "fsdp" else "DDP") + f" over {backend}"
        raise ValueError(f"training.parallel: {cfg.parallel} with gpus_per_worker: {g} needs {what}, which this "
                         f"torch build cannot do (torch {torch.__version__}, {backend} unavailable); "
                         + ("install a CUDA build of torch" if backend == "nccl" else "use a torch build with gloo"))
    if g > 0 and launcher == "local":
        n = torch.cuda.device_count() if cuda_devices is None else cuda_devices
        if w * g > n:
            raise ValueError(f"training.workers_per_point: {w} workers x gpus_per_worker {g} need {w * g} GPUs, "
                             f"this machine has {n}; lower workers_per_point or run under runner: ray on a cluster")


def _decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP2 shards one by one (a model's ``layers``/``blocks`` ModuleLists)."""
    return [block for name, mod in model.named_modules() if isinstance(mod, nn.ModuleList)
            and name.rsplit(".", 1)[-1] in ("layers", "blocks") for block in mod]


class DataParallel:
    """This process's place among the W workers of one point (the process group is initialised).

    Hooks :class:`tasks.training.loop._Trainer` calls: :meth:`wrap`, :meth:`micro_batches`,
    :meth:`grad_sync`, :meth:`sum_loss`, :meth:`save_checkpoint` / :meth:`load_checkpoint`
    (signatures of :func:`tasks.training.checkpoint.save_checkpoint` / ``load_checkpoint``),
    :meth:`full_state_dict` and :meth:`barrier`.
    """

    def __init__(self, mode: str, device: torch.device) -> None:
        if not dist.is_initialized():
            raise RuntimeError("DataParallel: torch.distributed is not initialised in this process")
        self.mode, self.device = mode, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._ddp: DistributedDataParallel | None = None
        self._sharded: nn.Module | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def wrap(self, model: nn.Module, *, compile: bool) -> nn.Module:
        """The module the loop calls forward on: DDP around ``model``, or ``model`` sharded in place."""
        if self.mode == "fsdp":
            for block in _decoder_blocks(model):
                fully_shard(block)
            fully_shard(model)
            self._sharded = model
            forward = model
        else:
            self._ddp = DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda"
                                                else None)
            forward = self._ddp
        return torch.compile(forward) if compile else forward

    def micro_batches(self, accum: int) -> range:
        """This rank's contiguous share of a step's ``accum`` micro-batches."""
        share = accum // self.world
        return range(self.rank * share, (self.rank + 1) * share)

    @contextlib.contextmanager
    def grad_sync(self, *, last: bool) -> Iterator[None]:
        """Around one micro-batch's forward and backward: gradients cross ranks only at the ``last``."""
        if self._sharded is not None:
            self._sharded.set_requires_gradient_sync(last)
            yield
        elif last or self._ddp is None:
            yield
        else:
            with self._ddp.no_sync():
                yield

    def sum_loss(self, loss_sum: torch.Tensor, count: int) -> int:
        """All-reduce the running training-loss sum (in place) and micro-batch count; returns the count."""
        both = torch.stack([loss_sum.to(torch.float64), torch.tensor(float(count), dtype=torch.float64,
                                                                     device=loss_sum.device)])
        dist.all_reduce(both)
        loss_sum.fill_(both[0])
        return int(both[1].item())

    def barrier(self) -> None:
        dist.barrier()

    # -- checkpoints ----------------------------------------------------------------------------

    def save_checkpoint(self, ckpt_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                        meta: dict[str, Any], extra_tensors: dict[str, torch.Tensor] | None = None) -> None:
        """DDP: rank 0 writes the one-process checkpoint (the state is replicated). FSDP: every rank
        writes its shards to ``state-<step>.dcp/``, then rank 0 the JSON that completes it."""
        if extra_tensors:
            raise ValueError("DataParallel: extra checkpoint tensors (RePB's state) need workers_per_point: 1")
        if self.mode != "fsdp":
            if self.is_main:
                save_checkpoint(ckpt_dir, step, model, optimizer, meta)
            dist.barrier()
            return
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(ckpt_dir / f"state-{step:08d}.dcp"))
        fault_point("train.checkpoint")
        dist.barrier()
        if self.is_main:
            write_json(ckpt_dir / f"state-{step:08d}.json", {**meta, "step": step, "format": "dcp",
                                                              "workers": self.world})
            remove_older_checkpoints(ckpt_dir, step)
        dist.barrier()

    def load_checkpoint(self, ckpt_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer
                        ) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
        """The newest complete checkpoint of ``ckpt_dir`` into this rank's model and optimizer."""
        if self.mode != "fsdp":
            return load_checkpoint(ckpt_dir, model, optimizer)
        files = checkpoint_files(ckpt_dir) if ckpt_dir.exists() else []
        if not files:
            return None
        step, path, js_path = files[-1]
        if path.suffix != ".dcp":
            raise ValueError(f"{path}: a one-process checkpoint, and this run is training.parallel: fsdp; resume "
                             "it with parallel: ddp, or delete it to restart this run")
        model_sd, optim_sd = get_state_dict(model, optimizer)  # also creates AdamW's state to load into
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return read_json(js_path), {}

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The unsharded weights on rank 0 (on the CPU), an empty dict on the others; collective."""
        if self.mode != "fsdp":
            return model.state_dict() if self.is_main else {}
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return full if self.is_main else {}


# --------------------------------------------------------------------------------------------
# One unit of work (a size under WSD, a point under cosine) on W workers


@dataclass(frozen=True, kw_only=True)
class PointJob:
    """What every worker needs to train one unit: token files by path (each rank memory-maps them
    and reads its own slice), the specs with their output folders, and the WSD stable folder."""

    specs: list[RunSpec]
    cfg: TrainingConfig
    train_path: str
    val_path: str
    out_dirs: list[str]
    stable_dir: str | None = None
    val_groups: np.ndarray | None = None  # each validation token's source label (small, sent along)
    val_docs_path: str | None = None


def _train_job(job: PointJob, parallel: DataParallel | None,
               on_metrics: Callable[[RunSpec], MetricsCallback | None] | None,
               progress: Callable[[RunSpec], ProgressCallback | None] | None,
               device: torch.device | str | None = None) -> list[TrainResult]:
    train_tokens, val_tokens = load_tokens(job.train_path), load_tokens(job.val_path)
    val_docs = load_tokens(job.val_docs_path, mmap=False) if job.val_docs_path else None
    if job.stable_dir is not None:
        return train_size_wsd(job.specs, job.cfg, train_tokens, val_tokens, job.out_dirs, job.stable_dir,
                              on_metrics=on_metrics, progress=progress, device=device, val_groups=job.val_groups,
                              val_docs=val_docs, parallel=parallel)
    return [train_model(spec, job.cfg, train_tokens, val_tokens, Path(d),
                        on_metrics=on_metrics(spec) if on_metrics else None,
                        progress=progress(spec) if progress else None, device=device,
                        val_groups=job.val_groups, val_docs=val_docs, parallel=parallel)
            for spec, d in zip(job.specs, job.out_dirs)]


def _run_rank(job: PointJob, parallel: DataParallel, channel: Any | None) -> None:
    """A worker's whole unit; rank 0 (``channel`` set) reports metrics, progress and the results."""
    report = channel is not None and parallel.is_main

    def on_metrics(spec: RunSpec) -> MetricsCallback | None:
        return (lambda m, step: channel.put(("metrics", spec.name, m, step))) if report else None

    def progress(spec: RunSpec) -> ProgressCallback | None:
        return (lambda step, total: channel.put(("progress", spec.name, step, total))) if report else None

    results = _train_job(job, parallel, on_metrics, progress)
    if report:
        channel.put(("result", [r.to_dict() for r in results]))


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when the process that started it dies (no orphan left in a collective)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _local_worker(rank: int, world: int, store: str, job: PointJob, channel: Any, environ: dict[str, str]) -> None:
    """Entry point of one locally started worker process."""
    # a forkserver child has the server's environment; take the launcher's (MLflow, CUDA, fault points)
    os.environ.clear()
    os.environ.update(environ)
    _die_with_parent()
    # its own process group: a fault point (tasks.common.faults) kills this worker, not the launcher
    os.setpgrp()
    try:
        set_process_threads(job.cfg.num_threads)
        if job.cfg.gpus_per_worker > 0:
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        dist.init_process_group(backend_for(job.cfg), init_method=f"file://{store}", rank=rank, world_size=world)
        try:
            _run_rank(job, DataParallel(job.cfg.parallel, device), channel)
        finally:
            dist.destroy_process_group()
    except BaseException:
        channel.put(("error", rank, traceback.format_exc()))
        raise


def _ray_worker(config: dict[str, Any]) -> None:
    """Ray Train's ``train_loop_per_worker``: Ray has initialised the process group and placed the device."""
    import ray.train  # noqa: PLC0415 — inside a Ray Train worker, where Ray is already imported
    import ray.train.torch  # noqa: PLC0415

    job: PointJob = config["job"]
    set_process_threads(job.cfg.num_threads)
    device = ray.train.torch.get_device() if job.cfg.gpus_per_worker > 0 else torch.device("cpu")
    rank = ray.train.get_context().get_world_rank()
    try:
        _run_rank(job, DataParallel(job.cfg.parallel, device), config["channel"])
    except BaseException:
        config["channel"].put(("error", rank, traceback.format_exc()))
        raise


class WorkerFailed(RuntimeError):
    """A worker of a scaled-out point exited with an error or was killed; the rerun resumes it."""


def _dispatch(event: tuple, by_name: dict[str, RunSpec], on_metrics, progress, sink: dict[str, Any]) -> None:
    kind = event[0]
    if kind == "metrics":
        cb = on_metrics(by_name[event[1]]) if on_metrics else None
        if cb is not None:
            cb(event[2], event[3])
    elif kind == "progress":
        cb = progress(by_name[event[1]]) if progress else None
        if cb is not None:
            cb(event[2], event[3])
    elif kind == "result":
        sink["results"] = [TrainResult.from_dict(d) for d in event[1]]
    elif kind == "error":
        sink.setdefault("errors", []).append((event[1], event[2]))


def _failure(what: str, sink: dict[str, Any]) -> WorkerFailed:
    errors = sink.get("errors", [])
    detail = "".join(f"\n--- rank {rank} ---\n{tb[-3000:]}" for rank, tb in errors)
    return WorkerFailed(f"{what}; rerun to resume from the newest checkpoint{detail}")


_FORKSERVER = multiprocessing.get_context("forkserver")
# the server imports torch, the loop and the Llama classes once; each worker then starts by fork
_FORKSERVER.set_forkserver_preload(["tasks.training.worker_preload"])


def _launch_local(job: PointJob, on_metrics, progress) -> list[TrainResult]:
    world = job.cfg.workers_per_point
    by_name = {s.name: s for s in job.specs}
    sink: dict[str, Any] = {}
    channel = _FORKSERVER.Queue()
    with tempfile.TemporaryDirectory(prefix="scalelab-rdzv-") as tmp:
        store = str(Path(tmp) / "store")
        procs = [_FORKSERVER.Process(target=_local_worker, args=(rank, world, store, job, channel, dict(os.environ)),
                                     name=f"scalelab-train-rank{rank}") for rank in range(world)]
        try:
            for p in procs:
                p.start()
            while True:
                try:
                    _dispatch(channel.get(timeout=0.2), by_name, on_metrics, progress, sink)
                    continue
                except queue_lib.Empty:
                    pass
                codes = [p.exitcode for p in procs]
                if any(c not in (None, 0) for c in codes) or all(c == 0 for c in codes):
                    break
            with contextlib.suppress(queue_lib.Empty):
                while True:
                    _dispatch(channel.get(timeout=0.5), by_name, on_metrics, progress, sink)
        finally:
            for p in procs:
                if p.exitcode is None:
                    p.kill()
                p.join()
    bad = [(rank, p.exitcode) for rank, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        rank, code = bad[0]
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        raise _failure(f"worker {rank} of {world} {how}", sink)
    if "results" not in sink:
        raise _failure(f"the {world} workers exited without rank 0's results", sink)
    return sink["results"]


def _launch_ray(job: PointJob, on_metrics, progress) -> list[TrainResult]:
    # Ray Train is needed only under runner: ray (the flow has joined the cluster); importing it costs seconds.
    import ray  # noqa: PLC0415
    from ray.train import RunConfig, ScalingConfig  # noqa: PLC0415
    from ray.train.torch import TorchConfig, TorchTrainer  # noqa: PLC0415
    from ray.util.queue import Queue  # noqa: PLC0415

    cfg = job.cfg
    world = cfg.workers_per_point
    if cfg.gpus_per_worker > 0:
        have = int(ray.cluster_resources().get("GPU", 0))
        if world * cfg.gpus_per_worker > have:
            raise ValueError(f"training.workers_per_point: {world} workers x gpus_per_worker {cfg.gpus_per_worker} "
                             f"need {world * cfg.gpus_per_worker} GPUs, the Ray cluster has {have}")
    channel = Queue()
    storage = Path(job.stable_dir or job.out_dirs[0]).resolve().parent / ".ray-train"
    trainer = TorchTrainer(
        _ray_worker, train_loop_config={"job": job, "channel": channel},
        scaling_config=ScalingConfig(num_workers=world, use_gpu=cfg.gpus_per_worker > 0),
        torch_config=TorchConfig(backend=backend_for(cfg)),
        run_config=RunConfig(name=f"train-{job.specs[0].size}-{os.getpid()}", storage_path=str(storage)))
    by_name = {s.name: s for s in job.specs}
    sink: dict[str, Any] = {}
    box: dict[str, BaseException] = {}

    def fit() -> None:
        try:
            trainer.fit()
        except BaseException as exc:  # noqa: BLE001 — re-raised below in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=fit, name="ray-train-fit")
    thread.start()
    while thread.is_alive() or not channel.empty():
        with contextlib.suppress(queue_lib.Empty):
            _dispatch(channel.get(timeout=0.2), by_name, on_metrics, progress, sink)
    thread.join()
    if "error" in box:
        raise _failure(f"Ray Train's {world} workers failed ({type(box['error']).__name__}: {box['error']})",
                       sink) from box["error"]
    if "results" not in sink:
        raise _failure(f"Ray Train's {world} workers finished without rank 0's results", sink)
    return sink["results"]


def train_points(job: PointJob, *, launcher: str = "local",
                 on_metrics: Callable[[RunSpec], MetricsCallback | None] | None = None,
                 progress: Callable[[RunSpec], ProgressCallback | None] | None = None,
                 device: torch.device | str | None = None) -> list[TrainResult]:
    """Train ``job``'s unit on ``cfg.workers_per_point`` workers; results in the order of its specs.

    W = 1: this process, the plain loop (``device`` as :func:`tasks.training.loop.train_model`).
    W > 1: ``launcher`` ``local`` (W processes here) or ``ray`` (Ray Train's ``TorchTrainer``).
    ``on_metrics`` / ``progress`` (per spec, as :func:`tasks.training.loop.train_size_wsd`) are
    called in this process with rank 0's reports. Raises :class:`WorkerFailed` when a worker dies;
    calling again resumes from the newest checkpoint.
    """
    if launcher not in ("local", "ray"):
        raise ValueError(f"pipeline.runner: must be 'local' or 'ray' to launch workers, got {launcher!r}")
    check_parallel(job.cfg, launcher=launcher)
    if job.cfg.workers_per_point == 1:
        return _train_job(job, None, on_metrics, progress, device)
    job = PointJob(specs=job.specs, cfg=job.cfg, train_path=str(Path(job.train_path).resolve()),
                   val_path=str(Path(job.val_path).resolve()), out_dirs=[str(Path(d).resolve()) for d in job.out_dirs],
                   stable_dir=str(Path(job.stable_dir).resolve()) if job.stable_dir else None,
                   val_groups=job.val_groups,
                   val_docs_path=str(Path(job.val_docs_path).resolve()) if job.val_docs_path else None)
    launch = _launch_ray if launcher == "ray" else _launch_local
    return launch(job, on_metrics, progress)
