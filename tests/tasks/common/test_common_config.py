from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from tasks.common.config import ConfigError, from_mapping, load_yaml, require, to_dict
from tasks.common.params import load_stage_config, stage_section


@dataclass(frozen=True, kw_only=True)
class Inner:
    bits: int = 4
    group_size: int = 32

    def __post_init__(self) -> None:
        require(2 <= self.bits <= 8, "bits", "must be in 2..8")


@dataclass(frozen=True, kw_only=True)
class Outer:
    lr: float = 1e-3
    name: str = "x"
    mode: Literal["a", "b"] = "a"
    sizes: tuple[int, ...] = (1, 2)
    inner: Inner = field(default_factory=Inner)
    named: dict[str, Inner] = field(default_factory=dict)
    limit: int | None = None


def test_builds_nested_and_coerces_lossless_types():
    cfg = from_mapping(Outer, {"lr": 1, "sizes": [3, 4], "inner": {"bits": 8}, "named": {"q": {"bits": 2}}, "limit": 5.0})
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)
    assert cfg.sizes == (3, 4)
    assert cfg.inner == Inner(bits=8)
    assert cfg.named["q"].bits == 2
    assert cfg.limit == 5 and isinstance(cfg.limit, int)
    assert to_dict(cfg)["sizes"] == [3, 4]


def test_scientific_notation_string_is_a_float():
    # PyYAML reads `1e-3` (no dot) as a string; a float field accepts it.
    assert from_mapping(Outer, {"lr": "1e-3"}).lr == pytest.approx(1e-3)


@pytest.mark.parametrize(
    "data, match",
    [
        ({"lr": "fast"}, r"f\.yaml: s\.lr: expected float, got str 'fast'"),
        ({"bogus": 1}, r"f\.yaml: s\.bogus: unknown key 'bogus' for Outer"),
        ({"mode": "c"}, r"s\.mode: expected one of \['a', 'b'\]"),
        ({"sizes": [1, "two"]}, r"s\.sizes\[1\]: expected int"),
        ({"inner": {"bits": 1}}, r"f\.yaml: s\.inner\.bits: must be in 2\.\.8"),
        ({"inner": {"nope": 1}}, r"s\.inner\.nope: unknown key"),
        ({"named": {"q": {"bits": "x"}}}, r"s\.named\.q\.bits: expected int"),
        ({"limit": True}, r"s\.limit: expected int"),
    ],
    ids=["wrong-type", "unknown-key", "bad-literal", "bad-list-item", "post-init", "nested-unknown", "dict-value", "bool-not-int"],
)
def test_errors_name_file_and_key(data, match):
    with pytest.raises(ConfigError, match=match):
        from_mapping(Outer, data, source="f.yaml", prefix="s")


def test_missing_required_key():
    @dataclass(frozen=True, kw_only=True)
    class Req:
        needed: int

    with pytest.raises(ConfigError, match="missing required key 's.needed'"):
        from_mapping(Req, {}, source="f.yaml", prefix="s")


def test_yaml_lines_point_at_the_key(tmp_path: Path):
    p = tmp_path / "training.yaml"
    p.write_text("training:\n  lr: 0.1\n  name: ok\n  bogus: 3\npresets: {}\n")
    data, lines = load_yaml(p)
    assert lines["training.bogus"] == 4
    with pytest.raises(ConfigError, match=rf"{p}:4: training\.bogus: unknown key"):
        from_mapping(Outer, data["training"], source=str(p), prefix="training", lines=lines)


def test_invalid_yaml_and_missing_file_name_the_file(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="bad.yaml: invalid YAML"):
        load_yaml(bad)
    with pytest.raises(ConfigError, match="nope.yaml: params file not found"):
        load_yaml(tmp_path / "nope.yaml")


def test_presets_override_base_and_report_preset_lines(tmp_path: Path):
    (tmp_path / "params").mkdir()
    (tmp_path / "params" / "training.yaml").write_text(
        "training:\n  lr: 0.1\n  sizes: [1, 2, 3]\npresets:\n  ci:\n    sizes: [1]\n    lr: oops\n"
    )
    demo = load_stage_config(Outer, tmp_path, "training", "demo")
    assert demo.sizes == (1, 2, 3)
    section, _, _ = stage_section(tmp_path, "training", "ci")
    assert section["sizes"] == [1]
    with pytest.raises(ConfigError, match=r"training\.yaml:7: training\.lr: expected float"):
        load_stage_config(Outer, tmp_path, "training", "ci")
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        load_stage_config(Outer, tmp_path, "training", "huge")


def test_unknown_preset_block_is_an_error(tmp_path: Path):
    (tmp_path / "params").mkdir()
    (tmp_path / "params" / "fit.yaml").write_text("fit: {}\npresets:\n  cii: {}\n")
    with pytest.raises(ConfigError, match=r"fit\.yaml:3: presets\.cii: unknown preset"):
        stage_section(tmp_path, "fit", "ci")


def test_the_check_vocabulary_words_its_errors_as_the_checks_it_replaced():
    from tasks.common.config import at_least, in_interval, positive

    at_least(1, 1, "n")
    with pytest.raises(ValueError, match=r"^n: must be >= 1, got 0$"):
        at_least(0, 1, "n")
    positive(0.5, "lr")
    with pytest.raises(ValueError, match=r"^lr: must be positive, got 0.0$"):
        positive(0.0, "lr")
    in_interval(0, 0, 1, "frac", "[)")
    with pytest.raises(ValueError, match=r"^frac: must be in \[0, 1\), got 1$"):
        in_interval(1, 0, 1, "frac", "[)")
    in_interval(1, 0, 1, "p", "(]")
    with pytest.raises(ValueError, match=r"^p: must be in \(0, 1\], got 0$"):
        in_interval(0, 0, 1, "p", "(]")
    with pytest.raises(ValueError, match=r"^p: must be in \(0, 1\), got nan$"):
        in_interval(float("nan"), 0, 1, "p", "()")
    with pytest.raises(ValueError, match="bounds"):
        in_interval(0.5, 0, 1, "p", "[[")
