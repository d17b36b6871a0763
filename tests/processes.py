"""Stopping what a test started: a process and everything under it."""

from __future__ import annotations

import contextlib
import subprocess


def stop_process_tree(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM ``proc`` and every process under it (servers such as infra/mlflow-ui.sh start their
    own), SIGKILL those still alive after ``timeout`` seconds, then reap ``proc``."""
    import psutil

    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    _, alive = psutil.wait_procs(tree, timeout=timeout)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    proc.wait(timeout=timeout)
