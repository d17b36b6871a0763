"""Threads and processes: torch's intra-op threads per process, BLAS limited to one thread, and
independent jobs in spawned worker processes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Mapping
from typing import Any, TypeVar

K = TypeVar("K", bound=Hashable)
R = TypeVar("R")

_PROCESS_THREADS: int | None = None


def set_process_threads(num_threads: int) -> None:
    """Set torch's intra-op threads once for this process (0 leaves torch's default).

    A process-wide setting: the train flow calls it before its thread pool starts, and a Ray
    worker's first task does; later calls with the same value are no-ops, and nothing restores it,
    so concurrent tasks of one process never race on toggling it.
    """
    # torch imported here, not at the top: map_processes' spawned workers import this module and
    # should not pay for torch unless their job needs it.
    import torch

    global _PROCESS_THREADS
    if num_threads > 0 and _PROCESS_THREADS != num_threads:
        torch.set_num_threads(num_threads)
        _PROCESS_THREADS = num_threads


def single_threaded_blas() -> contextlib.AbstractContextManager:
    """Limit BLAS to one thread inside the block.

    scipy's L-BFGS-B calls BLAS on 5x5 problems; with OpenBLAS's thread pool on a busy 2-core
    machine each call took ~3 ms instead of ~0.1 ms (measured: 17x slower per start).
    threadpoolctl comes with scikit-learn (an MLflow dependency); without it nothing is limited.
    """
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - fitting still works, only slower
        return contextlib.nullcontext()
    return threadpool_limits(limits=1, user_api="blas")


def map_processes(fn: Callable[..., R], jobs: Mapping[K, tuple[Any, ...]], n_jobs: int) -> dict[K, R]:
    """``{key: fn(*args)}`` for every ``key: args`` of ``jobs``, in ``min(n_jobs, len(jobs))``
    processes, or in this one when that is 1. The result keeps ``jobs``' order whatever finishes first.

    The workers are spawned, not forked: the caller may hold torch, BLAS or polars thread pools that a
    fork would copy locked. ``fn`` and its arguments must pickle (a module-level function), and each
    worker pays its imports once (a few seconds with torch), so this pays for jobs of seconds or more.
    """
    workers = min(n_jobs, len(jobs))
    if workers <= 1:
        return {key: fn(*args) for key, args in jobs.items()}
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {key: pool.submit(fn, *args) for key, args in jobs.items()}
        return {key: f.result() for key, f in futures.items()}
