"""Load every params file under every preset into its typed config (``scalelab check-params``)."""

from __future__ import annotations

from pathlib import Path

from tasks.common.config import ConfigError
from tasks.common.params import PRESETS, load_stage_config


def stage_configs() -> dict[str, type]:
    """params/<stage>.yaml -> the dataclass its section loads into."""
    from flows.runtime import PipelineConfig
    from tasks.compression.registry import CompressionConfig
    from tasks.curation.prepare import PrepareConfig
    from tasks.curation.recipes import CurationConfig
    from tasks.scaling.config import FitConfig
    from tasks.sparse.registry import SparseEvalConfig
    from tasks.training.config import TrainingConfig

    return {
        "pipeline": PipelineConfig,
        "prepare": PrepareConfig,
        "curation": CurationConfig,
        "training": TrainingConfig,
        "compression": CompressionConfig,
        "sparse_eval": SparseEvalConfig,
        "fit": FitConfig,
    }


def check_all(root: str | Path) -> list[str]:
    """Every problem found, as ``file:line: key: message`` strings (empty when all load)."""
    problems = []
    for stage, cls in stage_configs().items():
        for preset in PRESETS:
            try:
                load_stage_config(cls, root, stage, preset)
            except ConfigError as exc:
                problems.append(f"[{preset}] {exc}")
    return problems
