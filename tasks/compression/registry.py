"""Compression methods by name: each is one module, one params block and one test.

A method module registers a typed config and a function::

    @dataclass(frozen=True, kw_only=True)
    class RTNConfig(MethodSpec):
        method: Literal["rtn"] = "rtn"
        bits: int = 4

    @register_method("rtn", RTNConfig)
    def compress_rtn(model, cfg, *, calib_tokens=None) -> CompressedModel: ...

and ``params/compression.yaml`` names settings of it::

    compression:
      settings:
        rtn_w4_g32: {method: rtn, bits: 4, group_size: 32}
      enabled: []            # settings to run; empty = all

Every module in :mod:`tasks.compression` is imported the first time a method is looked up, so a new
method needs no edit here. Settings are built with :func:`tasks.common.config.from_mapping`, so a
misspelt key fails naming the file, the line and the key.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from torch import nn

from tasks.common.registry import MethodRegistry, MethodSpec, RegisteredMethod
from tasks.zoo.compressed import CompressedModel


# ---------------------------------------------------------------------------------------------
# Compression


CompressFn = Callable[..., CompressedModel]
"""``compress(model: nn.Module, cfg, *, calib_tokens: np.ndarray | None) -> CompressedModel``."""

METHODS: MethodRegistry[CompressFn] = MethodRegistry("compression method", "tasks.compression")


def register_method(name: str, config_cls: type[MethodSpec]) -> Callable[[CompressFn], CompressFn]:
    """Decorator registering ``compress(model, cfg, *, calib_tokens) -> CompressedModel`` as ``name``."""
    return METHODS.register(name, config_cls)


PruneFn = Callable[..., Any]
"""``prune(model: nn.Module, cfg, *, calib_tokens: np.ndarray | None) -> result`` where ``result`` has
``.model`` (the smaller, runnable model; the input is left unchanged) and ``.meta()`` (JSON-friendly record)."""

PRUNERS: MethodRegistry[PruneFn] = MethodRegistry("pruning method", "tasks.compression")
"""Structural methods (block removal, low-rank inheritance): their result changes the architecture, so
it is scored and recovered by the prune stage (:mod:`flows.prune`), not packed like a quantized model."""


def register_pruner(name: str, config_cls: type[MethodSpec]) -> Callable[[PruneFn], PruneFn]:
    """Decorator registering ``prune(model, cfg, *, calib_tokens) -> result`` as pruning method ``name``."""
    return PRUNERS.register(name, config_cls)


def get_method(name: str) -> RegisteredMethod[CompressFn]:
    """The registered method ``name`` (``.config_cls``, ``.fn``); ``KeyError`` listing known names."""
    return METHODS.get(name)


def parse_settings(
    mapping: Mapping[str, Any],
    source: str | None = None,
    lines: Mapping[str, int] | None = None,
    *,
    prefix: str = "compression.settings",
) -> dict[str, tuple[str, MethodSpec]]:
    """``compression.settings`` -> ``{setting: (method_name, cfg)}`` (see :meth:`MethodRegistry.parse_settings`)."""
    return METHODS.parse_settings(mapping, source, lines, prefix=prefix)


def compress(model: nn.Module, cfg: MethodSpec, *, calib_tokens: np.ndarray | None = None) -> CompressedModel:
    """Run the method ``cfg.method`` on ``model`` (which it leaves unchanged)."""
    return get_method(cfg.method).fn(model, cfg, calib_tokens=calib_tokens)
