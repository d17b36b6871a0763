"""What every flow shares: where outputs live, the pipeline config, the task runner, tracking.

A :class:`Context` is made once per command (``scalelab run ...``) and passed to each
stage flow; it is plain data, so it crosses into Ray workers unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tasks.common.config import require, to_dict
from tasks.common.params import default_preset, load_stage_config
from tasks.common.tracking import RunRef, tracking_uri

log = logging.getLogger("scalelab")


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """The ``pipeline:`` section of params/pipeline.yaml."""

    preset: Literal["ci", "demo", "full"] = "demo"
    experiment: str = "scalelab"
    runner: Literal["local", "ray"] = "local"
    local_workers: int = 1
    ray_address: str | None = None
    ray_num_cpus: int = 2
    gpus_per_train_task: float = 0.0
    # A RUNNING MLflow run from another host whose heartbeat is older than this is taken as killed.
    orphan_timeout_s: float = 900.0

    def __post_init__(self) -> None:
        require(self.local_workers >= 1, "local_workers", "must be >= 1")
        require(self.ray_num_cpus >= 1, "ray_num_cpus", "must be >= 1")
        require(self.gpus_per_train_task >= 0, "gpus_per_train_task", "must be >= 0")
        require(bool(self.experiment), "experiment", "must not be empty")
        require(self.orphan_timeout_s > 0, "orphan_timeout_s", "must be > 0")


@dataclass(frozen=True)
class Layout:
    """Every path the pipeline reads or writes, under one working folder."""

    workdir: Path

    @property
    def data(self) -> Path:
        return self.workdir / "data"

    @property
    def prepared(self) -> Path:
        return self.data / "prepared"

    @property
    def tokenizer(self) -> Path:
        return self.data / "tokenizer" / "tokenizer.json"

    @property
    def curated(self) -> Path:
        return self.data / "curated"

    @property
    def tokens(self) -> Path:
        return self.data / "tokens"

    @property
    def trained(self) -> Path:
        return self.workdir / "models" / "trained"

    @property
    def compressed(self) -> Path:
        return self.workdir / "models" / "compressed"

    @property
    def pruned(self) -> Path:
        return self.workdir / "models" / "pruned"

    @property
    def reports(self) -> Path:
        return self.workdir / "reports"

    @property
    def plots(self) -> Path:
        return self.reports / "plots"


@dataclass(frozen=True)
class Context:
    """One command's settings: project root (params), output folder, preset, runner, tracking."""

    root: Path
    workdir: Path
    preset: str
    pipeline: PipelineConfig
    tracking_uri: str
    parent: RunRef | None = None

    @property
    def layout(self) -> Layout:
        return Layout(self.workdir)

    @property
    def experiment(self) -> str:
        return self.pipeline.experiment

    def with_parent(self, parent: RunRef | None) -> "Context":
        return dataclasses.replace(self, parent=parent)

    def config(self, cls: type, stage: str) -> Any:
        """Load ``params/<stage>.yaml`` under this context's preset into ``cls``."""
        return load_stage_config(cls, self.root, stage, self.preset)


class WorkdirError(ValueError):
    """A workdir that cannot be created or written; the message names the path and the reason."""


def ensure_workdir(path: str | Path, what: str = "workdir") -> Path:
    """Resolve ``path`` (relative to the current folder, ``~`` expanded), create it with its parents,
    and check that files can be written in it; returns the absolute path.

    Raises :class:`WorkdirError` naming ``what`` and the path when it is a file, cannot be created,
    or is not writable. Nothing else is written (the probe file is removed).
    """
    import tempfile

    wd = Path(path).expanduser().resolve()
    if wd.exists() and not wd.is_dir():
        raise WorkdirError(f"{what} {wd}: exists and is not a folder")
    blocker = next((p for p in wd.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise WorkdirError(f"{what} {wd}: cannot be created, {blocker} is a file")
    try:
        wd.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".scalelab-write-probe-", dir=wd)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise WorkdirError(f"{what} {wd}: not writable ({exc.strerror or exc})") from None
    return wd


class WorkdirClaim:
    """This process's hold on a workdir: the MLflow runs its first claim ended as KILLED wait here
    until the first run opened under the claim takes them for its ``scalelab.replaces`` tag."""

    def __init__(self) -> None:
        self._replaced: list[str] = []

    def take_replaced(self) -> list[str]:
        out, self._replaced = self._replaced, []
        return out


_CLAIMS: dict[Path, WorkdirClaim] = {}


@contextlib.contextmanager
def claim_workdir(ctx: Context) -> Iterator[WorkdirClaim]:
    """Hold the workdir's writer lock (:func:`tasks.common.lock.workdir_lock`) for the block.

    On the process's first claim, clean up after a crashed predecessor before anything is written:
    its abandoned lock is taken over with a warning, its temporaries under ``data/``, ``models/``
    and ``reports/`` are removed (a folder caught mid-swap is restored), and its MLflow runs still
    RUNNING are ended as KILLED (their ids wait in :meth:`WorkdirClaim.take_replaced`). Nested
    claims in the same process (the CLI, then the pipeline, then each stage) share the hold.
    Raises :class:`~tasks.common.lock.WorkdirBusy` naming the holder when another live process
    writes the workdir.
    """
    from tasks.common.io import clean_temporaries
    from tasks.common.lock import describe, workdir_lock
    from tasks.common.tracking import close_orphaned_runs

    with workdir_lock(ctx.workdir) as lock:
        if not lock.fresh:
            yield _CLAIMS[ctx.workdir]
            return
        claim = _CLAIMS[ctx.workdir] = WorkdirClaim()
        try:
            if lock.previous:
                log.warning("workdir %s: taking over the lock left by %s, which is gone",
                            ctx.workdir, describe(lock.previous))
            layout = ctx.layout
            for folder in (layout.data, layout.workdir / "models", layout.reports):
                cleaned = clean_temporaries(folder)
                for p in cleaned["restored"]:
                    log.warning("restored %s from the copy a killed run left mid-swap", p)
                if cleaned["removed"]:
                    log.warning("removed %d temporaries a killed run left under %s", len(cleaned["removed"]), folder)
            claim._replaced = close_orphaned_runs(ctx.tracking_uri, ctx.experiment, workdir=ctx.workdir,
                                                  timeout_s=ctx.pipeline.orphan_timeout_s)
            if claim._replaced:
                log.warning("ended %d MLflow run(s) a killed process left RUNNING, as KILLED: %s",
                            len(claim._replaced), ", ".join(claim._replaced))
            yield claim
        finally:
            del _CLAIMS[ctx.workdir]


def make_context(
    root: str | Path = ".",
    *,
    preset: str | None = None,
    workdir: str | Path | None = None,
    runner: str | None = None,
    ray_address: str | None = None,
) -> Context:
    """Resolve a :class:`Context`; command-line choices override params/pipeline.yaml.

    A ``workdir`` is created if missing (:func:`ensure_workdir`); default: ``root``.
    """
    root = Path(root).resolve()
    preset = preset or default_preset(root)
    pipeline = load_stage_config(PipelineConfig, root, "pipeline", preset)
    changes: dict[str, Any] = {"preset": preset}
    if runner:
        changes["runner"] = runner
    ray_address = ray_address or os.environ.get("SCALELAB_RAY_ADDRESS")
    if ray_address:
        changes["ray_address"] = ray_address
    pipeline = dataclasses.replace(pipeline, **changes)
    workdir = ensure_workdir(workdir) if workdir else root
    parent_id = os.environ.get("SCALELAB_PARENT_RUN_ID")
    uri = tracking_uri(workdir)
    parent = RunRef(uri=uri, experiment=pipeline.experiment, run_id=parent_id) if parent_id else None
    return Context(root=root, workdir=workdir, preset=preset, pipeline=pipeline, tracking_uri=uri, parent=parent)


def task_runner(pipeline: PipelineConfig):
    """The Prefect task runner the config asks for: a local thread pool, or Ray through prefect-ray."""
    if pipeline.runner == "ray":
        try:
            from prefect_ray import RayTaskRunner
        except ImportError as exc:  # pragma: no cover - prefect-ray is a core dependency
            raise RuntimeError("runner: ray needs prefect-ray: pip install prefect-ray ray") from exc
        if pipeline.ray_address:
            return RayTaskRunner(address=pipeline.ray_address)
        return RayTaskRunner(init_kwargs={"num_cpus": pipeline.ray_num_cpus, "include_dashboard": False})
    from prefect.task_runners import ThreadPoolTaskRunner

    return ThreadPoolTaskRunner(max_workers=pipeline.local_workers)


def gpu_options(pipeline: PipelineConfig):
    """A context in which submitted tasks ask Ray for ``gpus_per_train_task`` GPUs (no-op locally)."""
    if pipeline.runner == "ray" and pipeline.gpus_per_train_task > 0:
        from prefect_ray.context import remote_options

        return remote_options(num_gpus=pipeline.gpus_per_train_task)
    return contextlib.nullcontext()


def config_hash(*parts: Any) -> str:
    """A short stable hash of configs/specs, used to key resumable outputs by what made them."""
    blob = json.dumps([to_dict(p) if dataclasses.is_dataclass(p) else p for p in parts], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


def map_tasks(pipeline: PipelineConfig, task: Any, jobs: list[dict[str, Any]], *, gpu: bool = True) -> list[Any]:
    """Submit ``task`` once per job (keyword arguments) through the configured runner; results in order.

    Locally a thread pool; under ``runner: ray`` one Ray task per job, asking for
    ``gpus_per_train_task`` GPUs when ``gpu``. Call inside a flow so task runs are recorded.
    """
    runner = task_runner(pipeline)
    with runner, (gpu_options(pipeline) if gpu else contextlib.nullcontext()):
        futures = [runner.submit(task, parameters=job) for job in jobs]
        return [f.result() for f in futures]
