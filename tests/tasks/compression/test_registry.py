"""tasks.compression.registry: methods by name, settings from params, and the compression section."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest
import torch
from torch import nn

from tasks.common.config import ConfigError
from tasks.common.params import PRESETS, load_stage_config, stage_section
from tasks.common.registry import MethodRegistry, MethodSpec
from tasks.compression import registry
from tasks.compression.config import CompressionConfig
from tasks.compression.registry import compress, get_method, parse_settings
from tasks.zoo import compressed
from tasks.zoo.compressed import CompressedModel, save_compressed
from tasks.compression.rtn import RTNConfig, compress_rtn

ROOT = Path(__file__).resolve().parents[3]


def test_rtn_is_found_without_importing_it_first():
    spec = get_method("rtn")
    assert spec.config_cls is RTNConfig and spec.fn is compress_rtn
    assert "rtn" in registry.METHODS.names()


def test_unknown_method_lists_the_known_ones():
    with pytest.raises(KeyError, match="registered: .*rtn"):
        get_method("gptq_but_misspelt")


def test_parse_settings_builds_typed_configs():
    parsed = parse_settings({
        "rtn_w4_g32": {"method": "rtn", "bits": 4, "group_size": 32},
        "rtn_w8": {"method": "rtn", "bits": 8},
    })
    assert parsed["rtn_w4_g32"] == ("rtn", RTNConfig(bits=4, group_size=32))
    assert parsed["rtn_w8"] == ("rtn", RTNConfig(bits=8))
    assert list(parsed) == ["rtn_w4_g32", "rtn_w8"]


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ({"method": "rtn", "bitz": 4}, r"f\.yaml:7: compression\.settings\.s\.bitz: unknown key 'bitz' for RTNConfig"),
        ({"method": "rtn", "bits": "four"}, r"compression\.settings\.s\.bits: expected int"),
        ({"method": "rtn", "bits": 12}, r"bits: must be in 2\.\.8"),
        ({"bits": 4}, r"compression\.settings\.s: missing required key 'method'"),
        ({"method": "awq"}, r"compression\.settings\.s\.method: unknown compression method 'awq'"),
    ],
    ids=["unknown_key", "wrong_type", "bad_value", "no_method", "unknown_method"],
)
def test_parse_settings_errors_name_file_and_key(entry, match):
    lines = {"compression.settings.s": 6, "compression.settings.s.bitz": 7, "compression.settings.s.method": 6}
    with pytest.raises(ConfigError, match=match):
        parse_settings({"s": entry}, "f.yaml", lines)


def test_register_method_rejects_a_second_owner_and_non_spec_configs():
    reg: MethodRegistry = MethodRegistry("toy method", "tasks.compression")

    @dataclass(frozen=True, kw_only=True)
    class ToyConfig(MethodSpec):
        method: Literal["toy"] = "toy"
        strength: float = 1.0

    @reg.register("toy", ToyConfig)
    def toy(model, cfg, *, calib_tokens=None):
        return CompressedModel(model=model, tensors={}, meta={})

    reg.register("toy", ToyConfig)(toy)  # re-registering the same function (a re-import) is fine

    def other(model, cfg, *, calib_tokens=None):
        raise AssertionError

    with pytest.raises(ValueError, match="already registered"):
        reg.register("toy", ToyConfig)(other)

    @dataclass(frozen=True)
    class NotASpec:
        method: str = "x"

    with pytest.raises(TypeError, match="MethodSpec"):
        reg.register("x", NotASpec)
    # A toy method's settings parse through the same path as RTN's.
    parsed = reg.parse_settings({"t": {"method": "toy", "strength": 2}}, prefix="p")
    assert parsed["t"] == ("toy", ToyConfig(strength=2.0))


def test_compress_dispatches_on_cfg_method():
    model = nn.Sequential(nn.Linear(16, 8))
    cm = compress(model, RTNConfig(bits=8, group_size=16, skip=()))
    assert set(cm.meta["quantized"]) == {"0.weight"}
    assert not torch.equal(cm.model[0].weight, model[0].weight)


@pytest.mark.parametrize("preset", PRESETS)
def test_params_file_loads_under_every_preset(preset):
    cfg = load_stage_config(CompressionConfig, ROOT, "compression", preset)
    methods = cfg.methods()
    assert methods and all(isinstance(c, MethodSpec) for _, c in methods.values())
    # Same settings when parsed with the file's own line numbers.
    section, source, lines = stage_section(ROOT, "compression", preset)
    assert set(parse_settings(section["settings"], source, lines)) >= set(methods)


def test_demo_and_full_run_every_method_on_the_ladder_and_smollm2_ci_a_subset_on_the_ladder():
    demo = load_stage_config(CompressionConfig, ROOT, "compression", "demo")
    ci = load_stage_config(CompressionConfig, ROOT, "compression", "ci")
    full = load_stage_config(CompressionConfig, ROOT, "compression", "full")
    assert {m for m, _ in demo.methods().values()} == {"rtn", "gptq", "anybcq", "nubitq"}
    assert {m for m, _ in ci.methods().values()} == {"rtn", "gptq"} and len(ci.methods()) == 2
    assert ci.calib_tokens > 0 and demo.calib_tokens > 0  # gptq/nubitq need calibration tokens
    assert ci.pretrained == () and demo.pretrained == full.pretrained == ("smollm2",)
    for cfg in (demo, full):
        assert {m for m, _ in cfg.pretrained_methods().values()} == {"rtn", "gptq", "anybcq", "nubitq"}
        assert cfg.pretrained_calib_tokens > 0
    # SmolLM2 in the demo: groups of 128 at 2-3 bits, its own (smaller) token counts; full keeps its own
    grouped = [c for _, c in demo.pretrained_methods().values() if hasattr(c, "group_size") and c.method != "nubitq"]
    assert grouped and all(c.group_size == 128 for c in grouped)
    assert {c.bits for c in grouped} <= {2, 3}
    assert demo.pretrained_eval_tokens < full.pretrained_eval_tokens == 16384
    assert demo.pretrained_calib_tokens < full.pretrained_calib_tokens == 16384


def test_pretrained_config_is_checked():
    with pytest.raises(ValueError, match="unknown pretrained model"):
        CompressionConfig(settings={"a": {"method": "rtn"}}, pretrained=("gpt5",))
    with pytest.raises(ValueError, match="pretrained_settings: names settings that are not defined"):
        CompressionConfig(settings={"a": {"method": "rtn"}}, pretrained_settings=("b",))
    cfg = CompressionConfig(settings={"a": {"method": "rtn"}, "b": {"method": "rtn", "bits": 8}}, enabled=("a",),
                            pretrained_settings=("b",))
    assert list(cfg.pretrained_methods()) == ["b"] and list(cfg.methods()) == ["a"]


def test_section_errors_point_at_the_params_file(tmp_path):
    (tmp_path / "params").mkdir()
    text = (ROOT / "params" / "compression.yaml").read_text()
    (tmp_path / "params" / "compression.yaml").write_text(text.replace("group_size: 32}", "group_sz: 32}", 1))
    with pytest.raises(ConfigError, match=r"compression\.yaml:12: compression\.settings\.rtn_w4_g32\.group_sz: unknown key"):
        load_stage_config(CompressionConfig, tmp_path, "compression", "demo")


def test_enabled_must_name_defined_settings():
    with pytest.raises(ValueError, match="enabled: names settings that are not defined"):
        CompressionConfig(settings={"a": {"method": "rtn"}}, enabled=("b",))
    cfg = CompressionConfig(settings={"a": {"method": "rtn"}, "b": {"method": "rtn", "bits": 8}}, enabled=("b",))
    assert list(cfg.methods()) == ["b"]


def test_save_compressed_is_atomic(tmp_path, monkeypatch):
    model = nn.Sequential(nn.Linear(8, 4))
    cm = compress(model, RTNConfig(bits=4, group_size=8, skip=()))
    path = tmp_path / "m.safetensors"
    save_compressed(cm, path)
    before = path.read_bytes()

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(compressed, "save_file", fail)
    with pytest.raises(OSError, match="disk full"):
        save_compressed(compress(model, RTNConfig(bits=8, group_size=8, skip=())), path)
    assert path.read_bytes() == before  # the old file is intact, no temp file left behind
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]
