"""params/: one YAML file per stage, each a base section plus preset overrides.

Layout of ``params/<stage>.yaml``::

    <stage>:            # the base values (what the `demo` preset uses)
      key: value
    presets:            # a few changed fields per preset, never a copied file
      ci:   {key: smaller}
      full: {key: larger}

``params/pipeline.yaml`` holds ``pipeline.preset``, which ``dvc repro`` and
``scalelab run`` use unless told otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

from tasks.common.config import ConfigError, deep_merge, from_mapping, load_yaml, shown, where

T = TypeVar("T")

PRESETS = ("ci", "demo", "full")
STAGES = ("pipeline", "prepare", "curation", "training", "compression", "pruning", "sparse_eval", "fit", "select")


#: A project root inside the package whose ``params/`` is the repository's (a link in the source
#: tree; a wheel build copies the files, as pyproject.toml's package-data says), so commands that
#: need only defaults (``scalelab curate``) run from any folder.
PACKAGED_ROOT = Path(__file__).resolve().parent / "default_root"


def params_dir(root: str | Path) -> Path:
    return Path(root) / "params"


def params_root(root: str | Path) -> Path:
    """``root`` when it holds ``params/pipeline.yaml``, else :data:`PACKAGED_ROOT` (the defaults
    shipped with scalelab)."""
    root = Path(root)
    return root if (params_dir(root) / "pipeline.yaml").is_file() else PACKAGED_ROOT


def stage_section(root: str | Path, stage: str, preset: str) -> tuple[dict[str, Any], str, dict[str, int]]:
    """The resolved mapping for ``stage`` under ``preset``, with its file name and key lines."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    path = params_dir(root) / f"{stage}.yaml"
    data, lines = load_yaml(path)
    source = shown(path)
    unknown = sorted(set(data) - {stage, "presets"})
    if unknown:
        raise ConfigError(f"{where(source, unknown[0], lines)}: unknown top-level key; expected {stage!r} and 'presets'")
    if stage not in data:
        raise ConfigError(f"{source}: missing top-level key {stage!r}")
    base = data[stage] or {}
    presets = data.get("presets") or {}
    if not isinstance(presets, dict):
        raise ConfigError(f"{where(source, 'presets', lines)}: expected a mapping of preset name to overrides")
    bad = sorted(set(presets) - set(PRESETS))
    if bad:
        raise ConfigError(f"{where(source, 'presets.' + str(bad[0]), lines)}: unknown preset; expected one of {', '.join(PRESETS)}")
    override = presets.get(preset) or {}
    # Lines of preset keys are reported under the stage's dotted names, so an error
    # in `presets.ci.lr` points at the line that set the value actually used.
    for key, line in list(lines.items()):
        p = f"presets.{preset}."
        if key.startswith(p):
            lines[f"{stage}.{key[len(p):]}"] = line
    return deep_merge(base, override), source, lines


def load_stage_config(cls: type[T], root: str | Path, stage: str, preset: str) -> T:
    """Load ``params/<stage>.yaml`` under ``preset`` into the typed config ``cls``."""
    section, source, lines = stage_section(root, stage, preset)
    return from_mapping(cls, section, source=source, prefix=stage, lines=lines)


def default_preset(root: str | Path) -> str:
    """``pipeline.preset`` from params/pipeline.yaml (the preset `dvc repro` runs)."""
    data, lines = load_yaml(params_dir(root) / "pipeline.yaml")
    preset = (data.get("pipeline") or {}).get("preset", "demo")
    if preset not in PRESETS:
        raise ConfigError(f"{where(str(params_dir(root) / 'pipeline.yaml'), 'pipeline.preset', lines)}: "
                          f"expected one of {list(PRESETS)}, got {preset!r}")
    return preset
