"""Typed, validated configs loaded from YAML.

Every step's config is a keyword-only dataclass that checks its own values in
``__post_init__``. :func:`from_mapping` builds one from a plain mapping (a
YAML section), rejecting unknown keys and wrong types with an error that names
the file, the dotted key and, where known, the line::

    cfg = from_mapping(TrainConfig, data["training"], source="params/training.yaml",
                       prefix="training", lines=lines)
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A params value is missing, unknown or of the wrong type. The message names file and key."""


def shown(path: str | Path) -> str:
    """``path`` as the user would type it: relative to the current folder when it lies inside it."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return str(path)


def where(source: str | None, key: str, lines: Mapping[str, int] | None = None) -> str:
    """Format ``file:line: key`` for error messages: the key's line, else its nearest parent's."""
    lines = lines or {}
    line, parent = None, key
    while parent and line is None:
        line = lines.get(parent)
        parent = parent.rpartition(".")[0]
    loc = source or "<config>"
    if line is not None:
        loc = f"{loc}:{line}"
    return f"{loc}: {key}" if key else loc


def load_yaml(path: str | Path) -> tuple[dict[str, Any], dict[str, int]]:
    """Read a YAML mapping and the 1-based line of every dotted key in it.

    Returns ``(data, lines)``; ``lines["training.lr"] == 12`` means the key
    ``lr`` under ``training`` is written on line 12. Raises :class:`ConfigError`
    naming the file for a missing file, a YAML syntax error or a non-mapping.
    """
    path, name = Path(path), shown(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{name}: params file not found") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{name}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{name}: invalid YAML: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{name}: expected a mapping at the top level, got {type(data).__name__}")
    lines: dict[str, int] = {}

    def walk(n: yaml.Node, prefix: str) -> None:
        if isinstance(n, yaml.MappingNode):
            seen: dict[str, int] = {}
            for k, v in n.value:
                key = f"{prefix}.{k.value}" if prefix else str(k.value)
                line = k.start_mark.line + 1
                if key in seen:  # YAML would keep the last one silently
                    raise ConfigError(f"{name}:{line}: {key}: repeated (first on line {seen[key]}); "
                                      f"keep one of them")
                seen[key] = lines[key] = line
                walk(v, key)
        elif isinstance(n, yaml.SequenceNode):
            for v in n.value:
                walk(v, prefix)

    if node is not None:
        walk(node, "")
    return data, lines


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str, source: str | None, lines: Mapping[str, int] | None) -> Any:
    """Check ``value`` against annotation ``tp``; convert where lossless (int -> float, list -> tuple)."""
    origin = get_origin(tp)
    args = get_args(tp)

    def fail(expected: str) -> ConfigError:
        return ConfigError(
            f"{where(source, key, lines)}: expected {expected}, got {type(value).__name__} {value!r}"
        )

    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key, source, lines)
            except ConfigError as exc:
                errors.append(exc)
        raise fail(" or ".join(_type_name(a) for a in args))
    if origin is Literal:
        if value not in args:
            raise ConfigError(
                f"{where(source, key, lines)}: expected one of {list(args)}, got {value!r}"
            )
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise fail(f"a mapping for {tp.__name__}")
        return from_mapping(tp, value, source=source, prefix=key, lines=lines)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise fail("bool")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
            return int(value)  # YAML writes 1e6 as a float
        raise fail("int")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # PyYAML reads "1e-3" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise fail("float")
    if tp is str:
        if isinstance(value, str):
            return value
        raise fail("str")
    if tp is Path:
        if isinstance(value, (str, Path)):
            return Path(value)
        raise fail("path")
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise fail(f"a list")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise fail(f"a list of {len(args)} items")
            items = [_coerce(v, a, f"{key}[{i}]", source, lines) for i, (v, a) in enumerate(zip(value, args))]
        else:
            item_tp = args[0] if args else Any
            items = [_coerce(v, item_tp, f"{key}[{i}]", source, lines) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin in (dict, Mapping, typing.Mapping):
        if not isinstance(value, Mapping):
            raise fail("a mapping")
        k_tp, v_tp = args if args else (Any, Any)
        return {
            _coerce(k, k_tp, f"{key}.{k}", source, lines): _coerce(v, v_tp, f"{key}.{k}", source, lines)
            for k, v in value.items()
        }
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise fail(_type_name(tp))
    return value


def from_mapping(
    cls: type[T],
    data: Mapping[str, Any] | None,
    *,
    source: str | None = None,
    prefix: str = "",
    lines: Mapping[str, int] | None = None,
) -> T:
    """Build dataclass ``cls`` from ``data``, checking keys and types.

    Unknown keys, missing required keys and wrong types raise
    :class:`ConfigError` naming ``source`` (the file), the dotted key under
    ``prefix`` and its line. ``ValueError`` from the dataclass's own
    ``__post_init__`` is re-raised as :class:`ConfigError` with the same location.
    """
    data = dict(data or {})
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        key = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        raise ConfigError(
            f"{where(source, key, lines)}: unknown key {unknown[0]!r} for {cls.__name__}; "
            f"known keys: {', '.join(sorted(fields))}"
        )
    kwargs = {}
    for name, field in fields.items():
        key = f"{prefix}.{name}" if prefix else name
        if name not in data:
            if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{where(source, prefix, lines)}: missing required key {key!r}")
            continue
        kwargs[name] = _coerce(data[name], hints[name], key, source, lines)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:
        # ``require`` messages start with the field ("settings.x.bits: ..."): point at its line.
        head, sep, rest = str(exc).partition(": ")
        if sep and head.split(".")[0] in fields and " " not in head:
            key = f"{prefix}.{head}" if prefix else head
            raise ConfigError(f"{where(source, key, lines)}: {rest}") from None
        raise ConfigError(f"{where(source, prefix, lines)}: {exc}") from None


def to_dict(cfg: Any) -> dict[str, Any]:
    """A config as plain JSON/YAML-friendly data (tuples become lists, paths strings)."""

    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        if isinstance(v, Path):
            return str(v)
        return v

    return plain(cfg)


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists are kept whole (as MLflow params want)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Recursively overlay ``override`` on ``base`` (mappings merge, anything else replaces)."""
    out = dict(base)
    for k, v in override.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def require(cond: bool, field: str, message: str) -> None:
    """Raise ``ValueError("field: message")`` unless ``cond``: the one check idiom of ``__post_init__``."""
    if not cond:
        raise ValueError(f"{field}: {message}")


# The shared vocabulary of ``require``: the checks every config repeats, each message written once.
# A failed check raises ``ValueError("field: must be ..., got value")``; ``from_mapping`` adds the
# params file, line and section, so the user reads ``params/x.yaml:12: section.field: must be ...``.

def at_least(value: float, bound: float, field: str) -> None:
    """``field: must be >= bound, got value`` unless ``value >= bound``."""
    require(value >= bound, field, f"must be >= {bound}, got {value}")


def positive(value: float, field: str) -> None:
    """``field: must be positive, got value`` unless ``value > 0``."""
    require(value > 0, field, f"must be positive, got {value}")


def in_interval(value: float, lo: float, hi: float, field: str, bounds: str = "[]") -> None:
    """``field: must be in [lo, hi), got value`` unless ``value`` lies in the interval; ``bounds`` gives
    its ends as written (``"[]"``, ``"[)"``, ``"(]"``, ``"()"``: ``[`` includes the end, ``(`` excludes it)."""
    if bounds not in ("[]", "[)", "(]", "()"):
        raise ValueError(f"bounds: expected one of [], [), (], (), got {bounds!r}")
    above = value >= lo if bounds[0] == "[" else value > lo
    below = value <= hi if bounds[1] == "]" else value < hi
    require(above and below, field, f"must be in {bounds[0]}{lo}, {hi}{bounds[1]}, got {value}")
