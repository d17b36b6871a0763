from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tasks.common.config import ConfigError, from_mapping
from tasks.common.params import PRESETS, load_stage_config
from tasks.training.config import RePBConfig, TrainingConfig
from tasks.lm.model import ModelShape
from tasks.training.design import seed_sizes
from tasks.training.design import ladder
ROOT = Path(__file__).resolve().parents[3]

from training_fixtures import tiny_config


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_loads(preset):
    cfg = load_stage_config(TrainingConfig, ROOT, "training", preset)
    specs = ladder(cfg)
    if cfg.compute_budgets:  # IsoFLOP: k sizes per budget (points two budgets share train once)
        assert len(specs) <= len(cfg.compute_budgets) * cfg.sizes_per_budget
        assert {s.compute_budget for s in specs} == set(cfg.compute_budgets)
    else:
        assert len(specs) == len(cfg.sizes) * len(cfg.token_budgets)
    assert len({s.name for s in specs}) == len(specs)


def test_demo_is_at_least_three_by_three_and_ci_is_small():
    demo = load_stage_config(TrainingConfig, ROOT, "training", "demo")
    ci = load_stage_config(TrainingConfig, ROOT, "training", "ci")
    # demo: an IsoFLOP design, >= 3 budgets with >= 3 sizes on each (>= 9 points); ci: a small grid
    assert len(demo.compute_budgets) >= 3 and demo.sizes_per_budget >= 3 and len(ladder(demo)) >= 9
    assert len(ci.sizes) * len(ci.token_budgets) <= 9
    assert max(s.d_model for s in ci.sizes) <= 64 and ci.seq_len <= 128
    # presets replace the size list whole (a mapping would be merged key by key)
    full = load_stage_config(TrainingConfig, ROOT, "training", "full")
    assert min(s.d_model for s in full.sizes) > max(s.d_model for s in demo.sizes)


@pytest.mark.parametrize("d_model, expected", [(32, 96), (64, 192), (96, 256), (100, 288), (768, 2048)])
def test_intermediate_size_rule(d_model, expected):
    assert ModelShape(d_model=d_model, n_layers=1, n_heads=2).intermediate_size == expected


@pytest.mark.parametrize("kwargs, field", [
    (dict(d_model=64, n_layers=1, n_heads=3), "n_heads"),        # not divisible
    (dict(d_model=36, n_layers=1, n_heads=4), "n_heads"),        # odd head_dim 9
    (dict(d_model=64, n_layers=0, n_heads=4), "n_layers"),
    (dict(d_model=64, n_layers=1, n_heads=4, n_kv_heads=3), "n_kv_heads"),
])
def test_model_shape_rejects(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ModelShape(**kwargs)


@pytest.mark.parametrize("change, field", [
    (dict(seq_len=1), "seq_len"),
    (dict(token_budgets=()), "token_budgets"),
    (dict(token_budgets=(100, 100)), "token_budgets"),
    (dict(lr=0.0), "lr"),
    (dict(warmup_frac=1.0), "warmup_frac"),
    (dict(eval_tokens=16), "eval_tokens"),
    (dict(betas=(0.9, 1.0)), "betas"),
    (dict(sizes=(ModelShape(d_model=32, n_layers=1, n_heads=2), ModelShape(d_model=32, n_layers=1, n_heads=4))), "sizes"),
])
def test_training_config_rejects(change, field):
    with pytest.raises(ValueError, match=field):
        tiny_config(**change)


@pytest.mark.parametrize("change, match", [
    (dict(seeds=(1, 1)), r"seeds.*duplicates"),
    (dict(seed=3, seeds=(1, 3)), r"seeds.*lists 3, which is `seed`"),
    (dict(seeds=(-1,)), r"seeds.*non-negative"),
    (dict(seeds=(1,), seed_sizes=("d48_l2",)), r"seed_sizes.*\['d48_l2'\].*sizes are \['d32_l1'\]"),
    (dict(seeds=(1,), seed_sizes=("d32_l1", "d32_l1")), r"seed_sizes.*duplicates"),
    (dict(seed_sizes=("d32_l1",)), r"seed_sizes.*seeds is empty.*cover no point"),
], ids=["duplicate", "equals-seed", "negative", "unknown-size", "duplicate-size", "no-seeds"])
def test_seed_config_errors_name_the_key(change, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(**change)


@pytest.mark.parametrize("change, match", [
    (dict(schedule="wsd", extra_branches=(0.0,)), r"extra_branches.*\(0, 1\)"),
    (dict(schedule="wsd", extra_branches=(1.0,)), r"extra_branches.*\(0, 1\)"),
    (dict(schedule="wsd", extra_branches=(0.5, 0.5)), r"extra_branches.*duplicates"),
    (dict(schedule="cosine", extra_branches=(0.5,)), r"extra_branches.*schedule: wsd"),
    (dict(arch_compare=("raw", "raw")), r"arch_compare.*duplicates"),
], ids=["zero", "one", "duplicate", "cosine", "arch-duplicate"])
def test_extra_branch_and_arch_compare_errors_name_the_key(change, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(**change)


def test_seed_sizes_must_have_a_point_in_the_ladder():
    """An IsoFLOP design may train no point of a size; extra seeds on it would cover nothing."""
    shapes = tuple(ModelShape(d_model=d, n_layers=1, n_heads=2) for d in (8, 16, 32, 64))
    cfg = tiny_config(sizes=shapes, token_budgets=(), compute_budgets=(1e9,), sizes_per_budget=2, seeds=(1,))
    have = sorted({s.size for s in ladder(cfg)}, key=lambda t: int(t[1:].split("_")[0]))
    missing = next(s.tag for s in shapes if s.tag not in have)
    assert set(seed_sizes(cfg, ladder(cfg))) == set(have)  # empty seed_sizes: every size with a point
    picked = dataclasses.replace(cfg, seed_sizes=(have[0],))
    assert seed_sizes(picked, ladder(picked)) == [have[0]]
    with pytest.raises(ValueError, match=rf"seed_sizes: '{missing}' has no point in the ladder"):
        seed_sizes(dataclasses.replace(cfg, seed_sizes=(missing,)), ladder(cfg))
    assert seed_sizes(dataclasses.replace(cfg, seeds=()), ladder(cfg)) == []


def test_repb_config_rejects_bad_ratio():
    with pytest.raises(ValueError, match="keep_ratio"):
        RePBConfig(keep_ratio=0.0)
    with pytest.raises(ValueError, match="weight_min"):
        RePBConfig(weight_min=1.5)


def test_from_mapping_reports_unknown_nested_key():
    data = {"sizes": [{"d_model": 32, "n_layers": 1, "n_heads": 2, "width": 3}], "token_budgets": [10]}
    with pytest.raises(ConfigError, match=r"training\.sizes\[0\]\.width"):
        from_mapping(TrainingConfig, data, source="params/training.yaml", prefix="training")


def test_steps_and_names():
    cfg = tiny_config(token_budgets=(1000, 4096, 10), batch_size=4, grad_accum=2, seq_len=32)
    specs = {s.tokens: s for s in ladder(cfg)}
    assert specs[4096].steps == 16 and specs[4096].tokens_trained == 4096
    assert specs[1000].steps == 4  # 1000 / 256 = 3.9 -> 4 steps
    assert specs[10].steps == 1    # at least one step
    assert specs[4096].name == "d32_l1_D4096"
    assert dataclasses.replace(cfg, seed=1).tokens_per_step == 256
