"""A ``concurrent.futures``-style executor over Ray tasks, for engines that take an ``executor``.

``RayExecutor(address=None)`` joins a cluster (or starts a local one); ``submit(fn, *args)`` runs
``fn`` as a Ray task and returns a ``concurrent.futures.Future``. Used as a context manager (or
with :meth:`shutdown`), it stops the local cluster it started, and leaves alone one that was
already running (a prefect-ray task runner's, another executor's).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable


class RayExecutor:
    def __init__(self, address: str | None = None, num_cpus: int | None = None, **remote_options: Any):
        import ray

        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            kwargs: dict[str, Any] = {"include_dashboard": False}
            if address:
                kwargs["address"] = address
            elif num_cpus:
                kwargs["num_cpus"] = num_cpus
            ray.init(**kwargs)
        self._ray = ray
        self._options = remote_options

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        remote = self._ray.remote(fn)
        if self._options:
            remote = remote.options(**self._options)
        return remote.remote(*args, **kwargs).future()

    def __enter__(self) -> "RayExecutor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def shutdown(self, wait: bool = True) -> None:
        if self._owns_ray and self._ray.is_initialized():
            self._ray.shutdown()
        self._owns_ray = False
