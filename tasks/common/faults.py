"""Named fault points: where the crash-safety tests kill a run at an exact, otherwise unlikely moment.

A fault point is a no-op unless ``$SCALELAB_FAULT`` names it::

    SCALELAB_FAULT=train.checkpoint@2 scalelab run all --preset ci

kills the process group with SIGKILL the second time this process reaches
``fault_point("train.checkpoint")`` (default: the first time). ``name:where`` counts only the
calls whose ``where`` matches, e.g. ``atomic_dir.swap:compressed`` for the swap of
``models/compressed`` and not of the folders earlier stages replace. Killing the whole group takes down
worker processes with the driver, as a preempted node or an OOM kill of the job would. The
points sit between the writes of a multi-file update, the moments a rerun must be able to trust:

* ``sharded.part``: a curation shard's files are written, its ``DONE`` marker is not;
* ``train.checkpoint``: a checkpoint's tensors are written, its JSON record is not;
* ``atomic_dir.swap``: the old folder is moved aside, the new one not yet in place.
"""

from __future__ import annotations

import os
import signal
import threading
from collections import Counter

_SEEN: Counter[str] = Counter()
_GUARD = threading.Lock()


def _target() -> tuple[str, str | None, int] | None:
    spec = os.environ.get("SCALELAB_FAULT", "").strip()
    if not spec:
        return None
    spec, _, nth = spec.partition("@")
    name, _, where = spec.partition(":")
    return name, where or None, int(nth) if nth else 1


def fault_point(name: str, where: str | None = None) -> None:
    """Kill this process group if ``$SCALELAB_FAULT`` asks for it at this point; otherwise nothing.
    ``where`` qualifies the point (a folder's name), for specs of the form ``name:where``."""
    target = _target()
    if target is None or target[0] != name or (target[1] is not None and target[1] != where):
        return
    key = f"{name}:{target[1]}"
    with _GUARD:
        _SEEN[key] += 1
        hit = _SEEN[key] == target[2]
    if hit:
        os.killpg(os.getpgrp(), signal.SIGKILL)
