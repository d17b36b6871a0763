"""Atomic file writes: a killed stage never leaves a half-written output a rerun would trust.

Every writer goes to a temporary file in the destination's folder, fsyncs it and
renames it over the destination (``os.replace`` is atomic on POSIX).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import polars as pl

from tasks.common.faults import fault_point

_UMASK_GUARD = threading.Lock()


def _plain_mode(folder: bool) -> int:
    """The mode a plain ``open``/``mkdir`` would give under the current umask (0644/0755 under 022);
    ``mkstemp``/``mkdtemp`` create 0600/0700, which other users, a web server or a DVC remote
    sync could not read."""
    with _UMASK_GUARD:  # os.umask can only be read by setting it
        mask = os.umask(0o022)
        os.umask(mask)
    return (0o777 if folder else 0o666) & ~mask


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
        os.chmod(tmp, _plain_mode(folder=False))
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


def _restore_plain_modes(folder: Path) -> None:
    """Give ``folder`` and everything in it the modes a plain write gives (execute bits kept on files).

    Not only our own writers fill an :func:`atomic_dir`: transformers' ``save_pretrained`` (5.x)
    writes ``model.safetensors`` through a temporary file and leaves it 0600.
    """
    file_mode, dir_mode = _plain_mode(folder=False), _plain_mode(folder=True)
    os.chmod(folder, dir_mode)
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                os.chmod(p, dir_mode)
        for name in filenames:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                os.chmod(p, file_mode | (os.stat(p).st_mode & 0o111 & dir_mode))


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
        _restore_plain_modes(tmp)
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
            fault_point("atomic_dir.swap", path.name)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


_TEMP_SUFFIX = ".tmp"
_OLD_MARK = ".old-"


def clean_temporaries(root: str | Path) -> dict[str, list[Path]]:
    """Remove what killed atomic writes left under ``root``; restore a folder caught mid-swap.

    Call only while holding the workdir's writer lock (:mod:`tasks.common.lock`): then every
    temporary is a dead writer's. Temporaries are named ``.<name>.<random>.tmp`` (files and
    folders, :func:`atomic_path`/:func:`atomic_dir`) and ``.<name>.old-<pid>`` (the previous
    folder during :func:`atomic_dir`'s two renames). A kill between those renames leaves
    ``<name>`` missing and ``.<name>.old-<pid>`` complete: it is renamed back, since it is the
    last complete version. Returns ``{"removed": [...], "restored": [...]}``.
    """
    import shutil

    removed: list[Path] = []
    restored: list[Path] = []
    root = Path(root)
    if not root.is_dir():
        return {"removed": removed, "restored": restored}
    for dirpath, dirnames, filenames in os.walk(root, topdown=True):
        here = Path(dirpath)
        for name in list(dirnames) + filenames:
            if not name.startswith("."):
                continue
            p = here / name
            if name.endswith(_TEMP_SUFFIX) or name.startswith(".scalelab-write-probe-"):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)
                removed.append(p)
            elif _OLD_MARK in name and p.is_dir():
                original = here / name[1:].rsplit(_OLD_MARK, 1)[0]
                if original.exists():
                    shutil.rmtree(p, ignore_errors=True)
                    removed.append(p)
                else:
                    os.replace(p, original)
                    restored.append(original)
            else:
                continue
            if name in dirnames:
                dirnames.remove(name)  # do not walk into what was just removed or moved
    return {"removed": removed, "restored": restored}
