"""Run independent jobs in spawned worker processes."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any, TypeVar

K = TypeVar("K", bound=Hashable)
R = TypeVar("R")


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
