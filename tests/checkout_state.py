"""What the test session may not touch: the checkout's own project state.

``make demo`` and ``scalelab run`` keep their state in the checkout (``.prefect/``, ``mlflow.db``,
``data/``, ``models/``, ``reports/``, ...). Tests work under temporary folders; tests/conftest.py
snapshots these paths when the session starts and fails the session if any file under them was
added, changed or removed by the end (a test that wrote there, or a subprocess it started with the
checkout as its working directory).
"""

from __future__ import annotations

import os
from pathlib import Path

# Top-level names in the checkout that hold a run's state (Makefile `clean`, .gitignore, dvc.yaml outs).
STATE_PATHS = (".prefect", "mlflow.db", "mlruns", "mlartifacts", "data", "models", "reports", "runs",
               "dvc_plots", ".scalelab", ".scalelab.lock", ".dvc/cache", ".dvc/tmp")

Snapshot = dict[str, tuple[int, int]]


def state_snapshot(root: Path, paths: tuple[str, ...] = STATE_PATHS) -> Snapshot:
    """``{relative path: (size, mtime_ns)}`` of every file under ``root/<p>`` for ``p`` in ``paths``
    (a path that does not exist contributes nothing)."""
    out: Snapshot = {}
    for rel in paths:
        top = root / rel
        if top.is_file() or top.is_symlink():
            files = [top]
        elif top.is_dir():
            files = [Path(d) / f for d, _, names in os.walk(top) for f in names]
        else:
            continue
        for f in files:
            try:
                st = f.lstat()
            except FileNotFoundError:  # removed while walking
                continue
            out[str(f.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


def state_changes(before: Snapshot, after: Snapshot) -> list[str]:
    """Lines naming each file added, changed or removed between two snapshots, sorted by path."""
    lines = []
    for path in sorted(before.keys() | after.keys()):
        if path not in before:
            lines.append(f"added    {path}")
        elif path not in after:
            lines.append(f"removed  {path}")
        elif before[path] != after[path]:
            lines.append(f"changed  {path}")
    return lines
