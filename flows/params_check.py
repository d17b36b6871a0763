"""Load every params file under every preset into its typed config (``scalelab check-params``)."""

from __future__ import annotations

from pathlib import Path

from flows.runtime import PipelineConfig
from tasks.common.config import ConfigError
from tasks.common.params import PRESETS, load_stage_config
from tasks.compression.config import CompressionConfig
from tasks.compression.pruning import PruningConfig
from tasks.curation.prepare import PrepareConfig
from tasks.curation.recipes import CurationConfig
from tasks.evaluation.config import EvaluateConfig
from tasks.scaling.config import FitConfig
from tasks.selection.config import SelectConfig
from tasks.sparse.registry import SparseEvalConfig
from tasks.training.config import TrainingConfig


def stage_configs() -> dict[str, type]:
    """params/<stage>.yaml -> the dataclass its section loads into (one entry per params file)."""
    return {
        "pipeline": PipelineConfig,
        "prepare": PrepareConfig,
        "curation": CurationConfig,
        "training": TrainingConfig,
        "compression": CompressionConfig,
        "pruning": PruningConfig,
        "sparse_eval": SparseEvalConfig,
        "evaluate": EvaluateConfig,
        "fit": FitConfig,
        "select": SelectConfig,
    }


def check_preset(root: str | Path, preset: str) -> list[str]:
    """Every problem of ``preset``'s params, as ``file:line: key: message`` strings (empty when all load).

    ``scalelab run`` calls it before it takes the workdir or starts Prefect, so a bad key in any
    stage's file stops the command before anything is written."""
    problems = []
    for stage, cls in stage_configs().items():
        try:
            load_stage_config(cls, root, stage, preset)
        except ConfigError as exc:
            problems.append(str(exc))
    return problems


def check_all(root: str | Path) -> list[str]:
    """:func:`check_preset` for every preset, each problem prefixed with ``[preset]``."""
    return [f"[{preset}] {p}" for preset in PRESETS for p in check_preset(root, preset)]
