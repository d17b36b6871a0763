"""Sparse-inference methods by name: each is one module, one params block and one test.

A method registers a config (a :class:`SparseMethodSpec`, which carries the ``sparsities`` to sweep)
and a function returning an :class:`ActivationSparsity` handle::

    @register_sparsifier("teal", TealConfig)
    def teal(model, cfg, *, sparsity, calib_tokens=None) -> ActivationSparsity: ...

    with teal(model, cfg, sparsity=0.5, calib_tokens=calib) as handle:   # hooks on
        loss = evaluate_loss(model, val_tokens, ...)
    handle.achieved_sparsity()                                            # hooks off, counts kept

``params/sparse_eval.yaml``::

    sparse_eval:
      settings:
        teal: {method: teal, sparsities: [0.25, 0.5, 0.65]}

Every module of :mod:`tasks.sparse` is imported when a method is first looked up.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from tasks.common.config import at_least, require
from tasks.common.registry import MethodRegistry, MethodSpec, RegisteredMethod
from tasks.zoo.models import PRETRAINED_MODELS
from tasks.sparse.retrieval import RetrievalConfig

SiteFn = Callable[[torch.Tensor], torch.Tensor]
"""Maps a module's input (..., d) to its sparsified version (same shape and dtype)."""


@dataclass(frozen=True, kw_only=True)
class SparseMethodSpec(MethodSpec):
    """A sparse-inference params entry: ``method``, the ``sparsities`` to evaluate, the method's fields."""

    sparsities: tuple[float, ...] = (0.25, 0.5, 0.65)

    def __post_init__(self) -> None:
        super().__post_init__()
        require(len(self.sparsities) > 0, "sparsities", "needs at least one level")
        require(all(0.0 <= s < 1.0 for s in self.sparsities), "sparsities",
                f"each must be in [0, 1), got {list(self.sparsities)}")
        require(len(set(self.sparsities)) == len(self.sparsities), "sparsities",
                f"has duplicates: {list(self.sparsities)}")


class ActivationSparsity(contextlib.AbstractContextManager):
    """Forward pre-hooks that replace the input of selected modules, counting the zeros they pass on.

    ``sites`` maps a qualified module name to ``(module, fn)``; while the handle is entered, each
    call of ``module(x, ...)`` runs as ``module(fn(x), ...)``. Hooks are removed on exit, also when
    the block raises. Counts accumulate across entries until :meth:`reset_counts`.

    Achieved sparsity of a site = zero entries in what the module received / entries received: the
    fraction of weight columns a sparse kernel (:func:`kernels.sparse_gemv.sparse_gemv`) would skip.
    Over several sites each is weighted by its ``out_features`` (the length of a skipped column), so
    :meth:`achieved_sparsity` is the fraction of weight reads skipped: a 1536-wide down projection's
    zeros count no more than a 576-wide gate's, and a greedy allocation that puts more sparsity on
    the wide input is compared with uniform at equal compute.
    """

    def __init__(self, model: nn.Module, sites: Mapping[str, tuple[nn.Module, SiteFn]], *,
                 meta: Mapping[str, Any] | None = None, around: Any = None) -> None:
        self.model = model
        self.sites = dict(sites)
        self.meta = dict(meta or {})
        self.around = around  # applied before the hooks and reverted after them (WINA's rotation)
        self._col = {n: float(getattr(m, "out_features", 1)) for n, (m, _) in self.sites.items()}
        self._handles: list[Any] = []
        self.reset_counts()

    def reset_counts(self) -> None:
        self._zeros: dict[str, torch.Tensor | int] = {n: 0 for n in self.sites}
        self._total: dict[str, int] = {n: 0 for n in self.sites}

    def _hook(self, name: str, fn: SiteFn):
        def pre_hook(module: nn.Module, args: tuple[Any, ...]):
            if not args:
                raise RuntimeError(f"{name}: expected the input as the first positional argument")
            y = fn(args[0])
            # Kept as a device tensor: no host sync per call.
            self._zeros[name] = self._zeros[name] + (y == 0).sum()
            self._total[name] += y.numel()
            return (y, *args[1:])

        return pre_hook

    def __enter__(self) -> ActivationSparsity:
        if self._handles:
            raise RuntimeError("this sparsity handle is already active")
        try:
            if self.around is not None:
                self.around.apply()
            for name, (module, fn) in self.sites.items():
                self._handles.append(module.register_forward_pre_hook(self._hook(name, fn)))
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self.around is not None and self.around.active:
            self.around.revert()

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def per_site(self) -> dict[str, float]:
        """Achieved sparsity of each site that has seen input (sites never called are left out)."""
        return {n: float(self._zeros[n]) / t for n, t in self._total.items() if t}

    def achieved_sparsity(self) -> float | None:
        """Weight reads skipped / weight reads over all sites and calls so far (each site's zeros
        times its ``out_features``); ``None`` before any input was seen."""
        total = sum(t * self._col[n] for n, t in self._total.items())
        if not total:
            return None
        return sum(float(z) * self._col[n] for n, z in self._zeros.items()) / total


SparsifyFn = Callable[..., ActivationSparsity]
"""``sparsify(model, cfg, *, sparsity: float, calib_tokens: np.ndarray | None) -> handle``: an
:class:`ActivationSparsity`, or an object with the same protocol (``with``, ``achieved_sparsity()``,
``meta``) such as :class:`tasks.sparse.attention.AttentionSparsity` for methods that skip KV pairs."""

SPARSIFIERS: MethodRegistry[SparsifyFn] = MethodRegistry("sparse-inference method", "tasks.sparse")


def register_sparsifier(name: str, config_cls: type[SparseMethodSpec]) -> Callable[[SparsifyFn], SparsifyFn]:
    """Decorator registering ``sparsify(model, cfg, *, sparsity, calib_tokens) -> ActivationSparsity``."""
    if not (isinstance(config_cls, type) and issubclass(config_cls, SparseMethodSpec)):
        raise TypeError(f"sparse-inference method {name!r}: config_cls must subclass SparseMethodSpec")
    return SPARSIFIERS.register(name, config_cls)


def get_sparsifier(name: str) -> RegisteredMethod[SparsifyFn]:
    return SPARSIFIERS.get(name)


def parse_settings(
    mapping: Mapping[str, Any],
    source: str | None = None,
    lines: Mapping[str, int] | None = None,
    *,
    prefix: str = "sparse_eval.settings",
) -> dict[str, tuple[str, SparseMethodSpec]]:
    """``sparse_eval.settings`` -> ``{setting: (method_name, cfg)}``; errors name file, line and key."""
    return SPARSIFIERS.parse_settings(mapping, source, lines, prefix=prefix)  # type: ignore[return-value]


def sparsify(model: nn.Module, cfg: SparseMethodSpec, *, sparsity: float,
             calib_tokens: np.ndarray | None = None) -> ActivationSparsity:
    """The handle of method ``cfg.method`` at ``sparsity`` (enter it to switch sparsity on)."""
    return get_sparsifier(cfg.method).fn(model, cfg, sparsity=sparsity, calib_tokens=calib_tokens)


@dataclass(frozen=True, kw_only=True)
class SparseEvalConfig:
    """The ``sparse_eval:`` section of params/sparse_eval.yaml.

    ``settings``: named method entries, each with its ``sparsities``. ``enabled``: settings to run
    (empty = all). ``models``: trained runs to evaluate by name (empty = all). ``eval_tokens``:
    validation tokens scored per (setting, sparsity); ``calib_tokens``: training tokens given to
    methods that calibrate (TEAL's threshold mode); ``seq_len`` (None = the model's training
    length) and ``batch_size`` of the evaluation windows. ``num_threads``: torch threads per
    process, set by the stage so its numbers do not depend on what ran before it.
    ``speed``: which points' sparse paths are timed against the dense ones (:mod:`tasks.sparse.speed`):
    ``all``, ``attention`` (QuoKA, ProxyAttn only: TEAL's and WINA's timing needs the C++ sparse
    GEMV, built on first use in about a minute) or ``none``.

    ``pretrained``: pretrained models also evaluated (``smollm2``: SmolLM2-135M), on the prepared
    validation text in their own tokenizer, with ``pretrained_settings`` (empty = the enabled ones),
    ``pretrained_eval_tokens`` (predictions scored, in whole windows of ``pretrained_seq_len``),
    ``pretrained_seq_len``, ``pretrained_batch_size`` and ``pretrained_num_threads``; ``retrieval``: the needle set (:class:`tasks.sparse.retrieval.
    RetrievalConfig` fields) each of their points is also scored on, ``{}`` = none.
    """

    settings: dict[str, dict[str, Any]]
    enabled: tuple[str, ...] = ()
    models: tuple[str, ...] = ()
    # trained series whose models this stage works on (e.g. [raw, dedup_gopher]); empty = every trained series
    variants: tuple[str, ...] = ()
    eval_tokens: int = 65536
    calib_tokens: int = 16384
    seq_len: int | None = None
    batch_size: int = 16
    num_threads: int = 1
    speed: Literal["all", "attention", "none"] = "all"
    pretrained: tuple[str, ...] = ()
    pretrained_settings: tuple[str, ...] = ()
    pretrained_eval_tokens: int = 4096
    pretrained_seq_len: int = 1024
    pretrained_batch_size: int = 2
    pretrained_num_threads: int = 2
    retrieval: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        require(len(self.settings) > 0, "settings", "needs at least one setting")
        SPARSIFIERS.validate_section(self.settings, self.enabled)
        at_least(self.eval_tokens, 2, "eval_tokens")
        at_least(self.calib_tokens, 0, "calib_tokens")
        require(self.seq_len is None or self.seq_len >= 1, "seq_len", f"must be >= 1, got {self.seq_len}")
        at_least(self.batch_size, 1, "batch_size")
        require(self.num_threads >= 0, "num_threads", f"must be >= 0 (0 = torch's default), got {self.num_threads}")
        require(len(set(self.models)) == len(self.models), "models", f"has duplicates: {list(self.models)}")
        unknown = [p for p in self.pretrained if p not in PRETRAINED_MODELS]
        require(not unknown, "pretrained", f"unknown pretrained model(s) {unknown}; known: {list(PRETRAINED_MODELS)}")
        missing = [n for n in self.pretrained_settings if n not in self.settings]
        require(not missing, "pretrained_settings", f"names settings that are not defined: {missing}")
        for name in ("pretrained_eval_tokens", "pretrained_seq_len"):
            require(getattr(self, name) >= 2, name, f"must be >= 2, got {getattr(self, name)}")
        require(self.pretrained_eval_tokens >= self.pretrained_seq_len, "pretrained_eval_tokens",
                f"scores whole windows of pretrained_seq_len={self.pretrained_seq_len} predictions; "
                f"{self.pretrained_eval_tokens} is less than one")
        require(self.speed in ("all", "attention", "none"), "speed",
                f"expected one of all, attention, none, got {self.speed!r}")
        at_least(self.pretrained_batch_size, 1, "pretrained_batch_size")
        require(self.pretrained_num_threads >= 0, "pretrained_num_threads",
                f"must be >= 0 (0 = torch's default), got {self.pretrained_num_threads}")
        if self.retrieval:
            try:
                RetrievalConfig(**self.retrieval)
            except (TypeError, ValueError) as e:
                raise ValueError(f"retrieval: {e}") from None

    def methods(self) -> dict[str, tuple[str, SparseMethodSpec]]:
        """The enabled settings as ``{setting: (method_name, cfg)}``, in file order."""
        parsed = parse_settings(self.settings)
        names = self.enabled or tuple(parsed)
        return {n: parsed[n] for n in names}

    def pretrained_methods(self) -> dict[str, tuple[str, SparseMethodSpec]]:
        """The settings run on pretrained models (``pretrained_settings``, else the enabled ones)."""
        parsed = parse_settings(self.settings)
        names = self.pretrained_settings or self.enabled or tuple(parsed)
        return {n: parsed[n] for n in names}

