"""Shell-style name patterns (``fnmatch``), as the params files write module names and settings."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable


def matches_any(name: str, patterns: Iterable[str]) -> bool:
    """Whether ``name`` matches at least one shell pattern in ``patterns``, case-sensitively on every
    platform (``fnmatch.fnmatchcase``); no patterns match nothing.

    >>> matches_any("model.layers.0.mlp.up_proj", ["*.mlp.*", "lm_head"])
    True
    >>> matches_any("lm_head", [])
    False
    """
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)
