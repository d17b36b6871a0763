"""The select stage's configs (tasks/selection/config.py): bad input names the key, every preset loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.common.config import ConfigError
from tasks.common.params import load_stage_config
from tasks.selection.config import SelectConfig

ROOT = Path(__file__).resolve().parents[3]


def test_bad_input_errors_name_the_problem(tmp_path: Path):
    with pytest.raises(ValueError, match="targets: expected a tag"):
        SelectConfig(targets=("big",))
    (tmp_path / "params").mkdir()
    (tmp_path / "params" / "select.yaml").write_text("select:\n  n_pool: 100\n  lamda: 0.3\n")
    with pytest.raises(ConfigError, match=r"params/select.yaml:3: select.lamda: unknown key 'lamda'"):
        load_stage_config(SelectConfig, tmp_path, "select", "demo")
    (tmp_path / "params" / "select.yaml").write_text("select:\n  lam: 1.5\n")
    with pytest.raises(ConfigError, match=r"params/select.yaml:2: select.lam: must be in \[0, 1\]"):
        load_stage_config(SelectConfig, tmp_path, "select", "demo")
    (tmp_path / "params" / "select.yaml").write_text("select:\n  pool: {shapes: [d15_l1]}\n")
    with pytest.raises(ConfigError, match=r"params/select.yaml.*select.pool.*d15_l1"):
        load_stage_config(SelectConfig, tmp_path, "select", "demo")


@pytest.mark.parametrize("preset", ["ci", "demo", "full"])
def test_params_file_loads(preset):
    cfg = load_stage_config(SelectConfig, ROOT, "select", preset)
    assert cfg.ks() and all(1 <= k < cfg.n_pool for k in cfg.ks())
