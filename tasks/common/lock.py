"""One workdir, one writer: an advisory lock held for as long as a command writes a workdir.

The lock is ``fcntl.flock`` on ``<workdir>/.scalelab.lock``; the kernel releases it when its
holder dies, even by SIGKILL, so a crashed run never blocks the next one. The file also records
the holder (pid, host, process start time, since when, the command), so a second writer is told
who holds the workdir, and a taker-over is told whose lock it found abandoned.

Within one process the lock is re-entrant (the pipeline holds it and each stage it runs takes it
again). Read-only commands (``scalelab check-params``, the MLflow UI) never take it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tasks.common.tracking import process_start_time

LOCK_FILE = ".scalelab.lock"


class WorkdirBusy(RuntimeError):
    """Another live process writes this workdir; the message names it (pid, host, since when)."""


@dataclass(frozen=True)
class Claim:
    """What taking the lock found: ``fresh`` (this process did not hold it already) and ``previous``,
    the record a dead holder left (None when it exited cleanly, or when not ``fresh``)."""

    fresh: bool
    previous: dict | None


@dataclass
class _Held:
    fd: int
    depth: int
    previous: dict | None


_HELD: dict[Path, _Held] = {}
_GUARD = threading.Lock()


def _holder_record() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "start": process_start_time(os.getpid()),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": " ".join(sys.argv)[:500]}


def _read_record(fd: int) -> dict | None:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = b""
    while chunk := os.read(fd, 65536):
        raw += chunk
    try:
        rec = json.loads(raw.decode() or "null")
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return rec if isinstance(rec, dict) else None


def describe(rec: dict | None) -> str:
    if not rec:
        return "an unknown process"
    return f"pid {rec.get('pid')} on {rec.get('host')} (since {rec.get('since')}: {rec.get('command') or '?'})"


@contextlib.contextmanager
def workdir_lock(workdir: str | Path) -> Iterator[Claim]:
    """Hold the workdir's writer lock for the block; yield a :class:`Claim` (whether this is the
    process's first hold, and the record of a dead previous holder whose lock was taken over).

    Raises :class:`WorkdirBusy` at once, naming the holder, when another live process holds it.
    """
    path = Path(workdir).resolve() / LOCK_FILE
    with _GUARD:
        held = _HELD.get(path)
        if held is not None:
            held.depth += 1
            fresh = False
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                rec = _read_record(fd)
                os.close(fd)
                raise WorkdirBusy(f"workdir {path.parent} is being written by {describe(rec)}; "
                                  f"wait for it to finish or use another --workdir") from None
            previous = _read_record(fd)  # a record under a free lock: its holder died without clearing it
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, json.dumps(_holder_record()).encode())
            os.fsync(fd)
            held = _HELD[path] = _Held(fd=fd, depth=1, previous=previous)
            fresh = True
    try:
        yield Claim(fresh=fresh, previous=held.previous if fresh else None)
    finally:
        with _GUARD:
            held.depth -= 1
            if held.depth == 0:
                del _HELD[path]
                with contextlib.suppress(OSError):
                    os.ftruncate(held.fd, 0)  # a clean exit leaves no record: nothing was abandoned
                os.close(held.fd)  # closing releases the flock
