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
from tasks.common.io import clean_temporaries
from tasks.common.lock import describe, workdir_lock
from tasks.common.params import default_preset, load_stage_config
from tasks.common.tracking import (
    OWNER_HOST, OWNER_PID, OWNER_START, RunRef, close_orphaned_runs, owner_gone, owner_tags, tracking_uri,
)

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
    with workdir_lock(ctx.workdir) as lock:
        tag_flow_run(ctx.workdir)
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
            crash_orphaned_flow_runs(ctx.workdir)
            claim._replaced = close_orphaned_runs(ctx.tracking_uri, ctx.experiment, workdir=ctx.workdir,
                                                  timeout_s=ctx.pipeline.orphan_timeout_s)
            if claim._replaced:
                log.warning("ended %d MLflow run(s) a killed process left RUNNING, as KILLED: %s",
                            len(claim._replaced), ", ".join(claim._replaced))
            yield claim
        finally:
            del _CLAIMS[ctx.workdir]


WORKDIR_FLOW_TAG, OWNER_FLOW_TAG = "scalelab.workdir:", "scalelab.owner:"


def workdir_flow_tag(workdir: Path) -> str:
    """The Prefect tag of the flow runs that write ``workdir`` (a hash: tags are short and a path is not)."""
    return WORKDIR_FLOW_TAG + hashlib.sha256(str(workdir).encode()).hexdigest()[:12]


def tag_flow_run(workdir: Path) -> None:
    """Tag the current Prefect flow run (if any) with ``workdir``'s tag and this process as its owner
    (``scalelab.owner:<host>:<pid>:<start>``), so the next claim of the workdir can tell an orphan:
    a flow run still RUNNING whose owner process is gone (:func:`crash_orphaned_flow_runs`)."""
    # Prefect loads with the first flow, as in task_runner
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    run_ctx = FlowRunContext.get()
    if run_ctx is None or run_ctx.flow_run is None:
        return
    owner = owner_tags()
    wanted = {workdir_flow_tag(workdir), f"{OWNER_FLOW_TAG}{owner[OWNER_HOST]}:{owner[OWNER_PID]}:{owner[OWNER_START]}"}
    tags = set(run_ctx.flow_run.tags or ())
    if wanted <= tags:
        return
    try:
        with get_client(sync_client=True) as client:  # the run's own client may be async
            client.update_flow_run(run_ctx.flow_run.id, tags=sorted(tags | wanted))
        run_ctx.flow_run.tags = sorted(tags | wanted)
    except Exception as exc:  # noqa: BLE001 — the run's work matters more than its tag
        log.warning("could not tag Prefect flow run %s with its workdir (%s: %s); if this process is killed, "
                    "the run stays RUNNING in the Prefect UI", run_ctx.flow_run.id, type(exc).__name__, exc)


def _flow_run_owner(tags: list[str]) -> dict[str, str] | None:
    for t in tags:
        if t.startswith(OWNER_FLOW_TAG):
            parts = t.removeprefix(OWNER_FLOW_TAG).rsplit(":", 2)  # host:pid:start (a host name has no ':')
            if len(parts) == 3:
                return {OWNER_HOST: parts[0], OWNER_PID: parts[1], OWNER_START: parts[2]}
    return None


def crash_orphaned_flow_runs(workdir: Path) -> list[str]:
    """Mark CRASHED the Prefect flow runs of ``workdir`` (:func:`workdir_flow_tag`) left RUNNING by a
    process that is gone (killed, OOM, power cut); returns their ids.

    Only runs this host's scalelab tagged are judged (the owner's pid and start time, as for MLflow's
    orphans in :func:`tasks.common.tracking.close_orphaned_runs`); a Prefect API that cannot be
    reached is logged as a warning: the cleanup never stops a run.
    """
    from prefect.client.orchestration import get_client  # Prefect loads with the first flow, as in task_runner
    from prefect.client.schemas.filters import (
        FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType, FlowRunFilterTags,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    crashed: list[str] = []
    try:
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
                tags=FlowRunFilterTags(all_=[workdir_flow_tag(workdir)]),
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING]))))
            for fr in runs:
                owner = _flow_run_owner(list(fr.tags or ()))
                reason = owner_gone(owner, timeout_s=float("inf")) if owner else None
                if reason is None:
                    continue
                client.set_flow_run_state(fr.id, Crashed(message=f"scalelab: {reason}; marked CRASHED by the next "
                                                                 f"command on {workdir}"), force=True)
                crashed.append(str(fr.id))
    except Exception as exc:  # noqa: BLE001
        log.warning("could not check Prefect for flow runs a killed process left RUNNING (%s: %s)",
                    type(exc).__name__, exc)
        return crashed
    if crashed:
        log.warning("marked %d Prefect flow run(s) a killed process left RUNNING as CRASHED: %s",
                    len(crashed), ", ".join(crashed))
    return crashed


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
    outcomes = map_outcomes(pipeline, task, jobs, gpu=gpu)
    for _, error in outcomes:
        if error is not None:
            raise error
    return [result for result, _ in outcomes]


def map_outcomes(pipeline: PipelineConfig, task: Any, jobs: list[dict[str, Any]], *, gpu: bool = True
                 ) -> list[tuple[Any, Exception | None]]:
    """:func:`map_tasks` that waits for every job: ``(result, None)`` per job that finished,
    ``(None, exception)`` per job that raised (each job runs to its end, whatever the others do).
    A ``BaseException`` that is no ``Exception`` (an interrupt) still propagates at once."""
    runner = task_runner(pipeline)
    out: list[tuple[Any, Exception | None]] = []
    with runner, (gpu_options(pipeline) if gpu else contextlib.nullcontext()):
        futures = [runner.submit(task, parameters=job) for job in jobs]
        for f in futures:
            try:
                out.append((f.result(), None))
            except Exception as exc:  # noqa: BLE001 — the caller decides what a unit's failure means
                out.append((None, exc))
    return out
