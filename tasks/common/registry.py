"""Methods by name: a typed config and a function per method, found by importing a package's modules.

A stage keeps one :class:`MethodRegistry` per kind of method (compression's ``METHODS`` and
``PRUNERS``, sparse inference's ``SPARSIFIERS``); a method module registers itself with a decorator,
so a new method needs no edit to the registry. Settings are built with
:func:`tasks.common.config.from_mapping`, so a misspelt key fails naming the file, the line and the key.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from tasks.common.config import ConfigError, from_mapping, require, where

_SETTING_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True, kw_only=True)
class MethodSpec:
    """One params entry: ``method`` names the registered method; subclasses add the method's own fields.

    Subclasses narrow ``method`` to their name (``method: Literal["rtn"] = "rtn"``) so a config built
    in code needs no ``method=`` and one built from YAML is checked against its entry.
    """

    method: str

    def __post_init__(self) -> None:
        require(bool(self.method), "method", "must name a registered method")


@dataclass(frozen=True)
class RegisteredMethod(Generic[F]):
    """A registry row: the method's name, its config class and its function."""

    name: str
    config_cls: type[MethodSpec]
    fn: F


class MethodRegistry(Generic[F]):
    """Name -> (config class, function), filled by importing every module of ``package``.

    Shared by compression (``tasks.compression.registry``) and sparse inference (``tasks.sparse.registry``).
    """

    def __init__(self, kind: str, package: str) -> None:
        self.kind = kind
        self.package = package
        self._methods: dict[str, RegisteredMethod[F]] = {}
        self._discovered = False

    def register(self, name: str, config_cls: type[MethodSpec]) -> Callable[[F], F]:
        """Decorator: register ``fn`` under ``name`` with its config dataclass ``config_cls``."""
        if not (isinstance(config_cls, type) and dataclasses.is_dataclass(config_cls) and issubclass(config_cls, MethodSpec)):
            raise TypeError(f"{self.kind} {name!r}: config_cls must be a MethodSpec dataclass, got {config_cls!r}")
        if not _SETTING_NAME.match(name):
            raise ValueError(f"{self.kind} name {name!r}: use letters, digits, '_', '.', '-'")

        def decorator(fn: F) -> F:
            old = self._methods.get(name)
            same = old is not None and (old.fn.__module__, old.fn.__qualname__) == (fn.__module__, fn.__qualname__)
            if old is not None and not same:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered by {old.fn.__module__}.{old.fn.__qualname__}"
                )
            self._methods[name] = RegisteredMethod(name, config_cls, fn)
            return fn

        return decorator

    def _discover(self) -> None:
        if self._discovered:
            return
        pkg = importlib.import_module(self.package)
        for info in pkgutil.iter_modules(pkg.__path__):
            if not info.name.startswith("_") and info.name != "registry":
                importlib.import_module(f"{self.package}.{info.name}")
        self._discovered = True

    def names(self) -> list[str]:
        self._discover()
        return sorted(self._methods)

    def get(self, name: str) -> RegisteredMethod[F]:
        self._discover()
        try:
            return self._methods[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; registered: {', '.join(self.names()) or 'none'}") from None

    def parse_settings(
        self,
        mapping: Mapping[str, Any],
        source: str | None = None,
        lines: Mapping[str, int] | None = None,
        *,
        prefix: str,
    ) -> dict[str, tuple[str, MethodSpec]]:
        """Build each named setting's config: ``{name: (method_name, cfg)}``.

        Raises :class:`ConfigError` naming ``source``, the line and the dotted key for an unknown
        method, a missing ``method`` key, an unknown field or a bad value.
        """
        if not isinstance(mapping, Mapping):
            raise ConfigError(f"{where(source, prefix, lines)}: expected a mapping of setting name to method entry")
        out: dict[str, tuple[str, MethodSpec]] = {}
        for name, entry in mapping.items():
            key = f"{prefix}.{name}"
            if not isinstance(name, str) or not _SETTING_NAME.match(name):
                raise ConfigError(f"{where(source, key, lines)}: setting names use letters, digits, '_', '.', '-'")
            if not isinstance(entry, Mapping):
                raise ConfigError(f"{where(source, key, lines)}: expected a mapping with a 'method' key, got {entry!r}")
            if "method" not in entry:
                raise ConfigError(f"{where(source, key, lines)}: missing required key 'method' "
                                  f"(one of {', '.join(self.names())})")
            method = entry["method"]
            try:
                spec = self.get(method)
            except (KeyError, TypeError):
                raise ConfigError(f"{where(source, key + '.method', lines)}: unknown {self.kind} {method!r}; "
                                  f"registered: {', '.join(self.names())}") from None
            cfg = from_mapping(spec.config_cls, entry, source=source, prefix=key, lines=lines)
            if cfg.method != method:
                raise ConfigError(f"{where(source, key + '.method', lines)}: {spec.config_cls.__name__} "
                                  f"is for method {cfg.method!r}, not {method!r}")
            out[name] = (method, cfg)
        return out

    def validate_section(self, settings: Mapping[str, Any], enabled: tuple[str, ...]) -> None:
        """``__post_init__`` check of a stage section: settings parse, ``enabled`` names exist.

        Raises ``ValueError`` (which :func:`from_mapping` reports with the params file).
        """
        try:
            self.parse_settings(settings, prefix="settings")
        except ConfigError as exc:
            raise ValueError(str(exc).removeprefix("<config>: ")) from None
        unknown = [n for n in enabled if n not in settings]
        require(not unknown, "enabled", f"names settings that are not defined: {unknown}; defined: {sorted(settings)}")
        require(len(set(enabled)) == len(enabled), "enabled", f"has duplicates: {list(enabled)}")
