"""What the forkserver of :mod:`tasks.training.distributed` imports once, before forking workers.

Each locally launched worker is forked from that server, so the imports below (torch, the loop,
and ``transformers``' lazily imported Llama classes, the slow part: seconds on a loaded machine)
are paid once per launching process instead of once per worker and launch.
"""

from __future__ import annotations

import tasks.training.distributed  # noqa: F401  (the worker's entry point and everything it imports)
from tasks.lm.model import resolve_llama_classes

resolve_llama_classes()
