"""Every params file loads into its typed config under every preset; bad values name file and key."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from flows.params_check import check_all, stage_configs
from tasks.common.config import ConfigError
from tasks.common.params import PRESETS, load_stage_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("stage", list(stage_configs()))
def test_params_file_loads(stage, preset):
    load_stage_config(stage_configs()[stage], ROOT, stage, preset)


def test_check_all_is_clean():
    assert check_all(ROOT) == []


def test_training_preset_sizes_meet_the_issue(tmp_path):
    from tasks.training.config import TrainingConfig

    demo = load_stage_config(TrainingConfig, ROOT, "training", "demo")
    budgets = demo.compute_budgets or demo.token_budgets
    assert len(demo.sizes) >= 3 and len(budgets) >= 3


def test_a_typo_in_a_real_params_file_names_file_line_and_key(tmp_path):
    shutil.copytree(ROOT / "params", tmp_path / "params")
    path = tmp_path / "params" / "training.yaml"
    lines = path.read_text().splitlines()
    idx = next(i for i, l in enumerate(lines) if l.strip().startswith("lr:"))
    lines[idx] = lines[idx].replace("lr:", "learning_rate:")
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=rf"training\.yaml:{idx + 1}: training\.learning_rate: unknown key"):
        load_stage_config(stage_configs()["training"], tmp_path, "training", "demo")
    problems = check_all(tmp_path)
    assert len(problems) == len(PRESETS) and all("learning_rate" in p for p in problems)


def test_every_params_file_has_a_config():
    """check-params and `scalelab run`'s pre-flight load every file of params/, none forgotten."""
    assert set(stage_configs()) == {p.stem for p in (ROOT / "params").glob("*.yaml")}
