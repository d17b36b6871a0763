"""Atomic file writes: a killed stage never leaves a half-written output a rerun would trust.

Every writer goes to a temporary file in the destination's folder, fsyncs it and
renames it over the destination (``os.replace`` is atomic on POSIX).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import polars as pl


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success rename it to ``path``, else delete it.

    >>> with atomic_path("out/table.parquet") as tmp:
    ...     frame.write_parquet(tmp)
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path: str | Path, text: str) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_bytes(path: str | Path, data: bytes) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_json(path: str | Path, obj: Any) -> Path:
    """Write ``obj`` as indented JSON; NaN/inf are refused (they are not JSON) rather than written."""
    return write_text(path, json.dumps(obj, indent=2, sort_keys=False, allow_nan=False, default=str) + "\n")


def write_parquet(path: str | Path, frame: pl.DataFrame) -> Path:
    with atomic_path(path) as tmp:
        frame.write_parquet(tmp)
    return Path(path)


def write_csv(path: str | Path, frame: pl.DataFrame) -> Path:
    with atomic_path(path) as tmp:
        frame.write_csv(tmp)
    return Path(path)


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a fresh temporary folder beside ``path``; on success it replaces ``path`` whole.

    A stage that writes many files (shards, one folder per variant) builds them here, so a
    kill mid-way leaves the previous folder (or none), never a mix of old and new files.
    """
    import shutil

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
