"""Provenance of a run: the code that made it (git commit, dirty flag) and the params it read (the
params files its DVC stage declares, and their hash), as MLflow run tags.

:func:`source_tags` gives ``mlflow.source.git.commit``, ``scalelab.git.dirty`` and
``scalelab.params_hash`` (sha256 of the params files the stage declares in ``dvc.yaml``), which
:func:`tasks.common.tracking.tracked_run` puts on every run.
"""

from __future__ import annotations

import functools
import hashlib
import subprocess
from collections.abc import Iterable
from pathlib import Path

import yaml

GIT_COMMIT, GIT_DIRTY, PARAMS_HASH, PARAMS_FILES = (
    "mlflow.source.git.commit", "scalelab.git.dirty", "scalelab.params_hash", "scalelab.params_files")
SOURCE_TAGS = (GIT_COMMIT, GIT_DIRTY, PARAMS_HASH, PARAMS_FILES)


@functools.lru_cache(maxsize=8)
def git_state(repo: str) -> dict[str, str]:
    """``{commit, dirty}`` of the git checkout at ``repo`` (``dirty``: tracked files differ from the
    commit), or ``{}`` when it is not a checkout or git is missing. Once per process and repo."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, check=True,
                              timeout=30).stdout.strip()
    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"commit": commit, "dirty": "true" if dirty else "false"}


def stage_params_files(root: str | Path, stage: str) -> list[Path]:
    """The params files ``dvc.yaml`` (in ``root``) declares for ``stage``; every ``params/*.yaml`` for
    a stage it does not list (the pipeline's parent run) or when there is no dvc.yaml."""
    root = Path(root)
    dvc_yaml = root / "dvc.yaml"
    if dvc_yaml.exists():
        try:
            stages = (yaml.safe_load(dvc_yaml.read_text()) or {}).get("stages") or {}
        except yaml.YAMLError as exc:
            raise ValueError(f"{dvc_yaml}: not valid YAML ({exc})") from None
        declared = (stages.get(stage) or {}).get("params") or []
        files = []
        for entry in declared:
            names = list(entry) if isinstance(entry, dict) else [] if ":" not in str(entry) else [str(entry).split(":")[0]]
            files += [root / n for n in names]
        if files:
            return sorted(set(files))
    return sorted((root / "params").glob("*.yaml"))


def params_hash(files: Iterable[Path]) -> str:
    """sha256 (16 hex digits) over the files' names and bytes; a missing file raises naming it."""
    h = hashlib.sha256()
    for f in sorted(Path(p) for p in files):
        if not f.exists():
            raise FileNotFoundError(f"{f}: params file declared for this stage does not exist")
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def code_repo() -> Path:
    """The checkout scalelab's code runs from (the folder holding ``tasks/``)."""
    return Path(__file__).resolve().parents[2]


def source_tags(root: str | Path | None = None, stage: str | None = None) -> dict[str, str]:
    """The run tags naming the code (git commit, dirty flag) and, with ``root`` and ``stage``, the
    params files and their hash."""
    tags = {}
    state = git_state(str(code_repo()))
    if state:
        tags[GIT_COMMIT] = state["commit"]
        tags[GIT_DIRTY] = state["dirty"]
    if root is not None and stage is not None:
        files = stage_params_files(root, stage)
        tags[PARAMS_HASH] = params_hash(files)
        tags[PARAMS_FILES] = ",".join(str(f.relative_to(Path(root))) if f.is_relative_to(Path(root)) else str(f)
                                      for f in files)
    return tags
