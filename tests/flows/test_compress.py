"""flows.compress: the calibration/evaluation overlap guard, multi-precision rows, and one model's settings end to end."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from flows.compress import calib_eval_overlap, check_overlap, precision_models, run_settings
from tasks.common.tracking import tracked_run
from tasks.compression.anybcq import AnyBCQConfig
from tasks.compression.registry import compress, parse_settings
from tasks.compression.rtn import RTNConfig
from tests.tasks.compression.conftest import self_samples
from tests.tasks.compression.test_rtn import tiny_llama


def test_overlap_is_zero_for_disjoint_text_and_one_for_the_eval_set_itself():
    rng = np.random.default_rng(0)
    calib, val = rng.integers(0, 512, 5000), rng.integers(0, 512, 3000)
    assert calib_eval_overlap(calib, val) == 0.0
    assert calib_eval_overlap(val, val) == 1.0
    half = np.concatenate([calib, val[:1500]])
    assert calib_eval_overlap(half, val) == pytest.approx(0.5, abs=0.05)
    with pytest.raises(ValueError, match="calibrate on the training split"):
        check_overlap(calib_eval_overlap(half, val), "m")
    with pytest.warns(RuntimeWarning, match="also occur"):
        check_overlap(0.005, "m")
    check_overlap(0.0, "m")  # silent


def test_an_anybcq_artifact_gives_one_model_per_precision():
    model = tiny_llama()
    cm = compress(model, AnyBCQConfig(bits=3, group_size=32, weighting="none"))
    got = precision_models(cm, model)
    assert [b for b, _, _ in got] == [2, 3, 4]
    assert got[1][2] is cm.model and got[0][1] < got[1][1] < got[2][1]
    rtn = compress(model, RTNConfig(bits=4, group_size=32))
    assert [(b, bpw) for b, bpw, _ in precision_models(rtn, model)] == [(4, 5.0)]


def test_run_settings_scores_every_precision_and_refuses_calibrating_on_eval(tmp_path):
    model = tiny_llama()
    text = self_samples(model, 16, 64, seed=5).flatten().numpy()
    calib, val = text[:512], text[512:]
    settings = parse_settings({"rtn": {"method": "rtn", "bits": 4, "group_size": 32},
                               "bcq": {"method": "anybcq", "group_size": 32},
                               "gptq": {"method": "gptq", "bits": 3, "group_size": 32, "seq_len": 64}})
    uri = os.environ["MLFLOW_TRACKING_URI"]
    with tracked_run("test-compress", uri=uri) as parent:
        kw = dict(model=model, model_name="tiny", base_row={"variant": "v", "run": "tiny", "n_params": 1, "tokens": 1},
                  settings=settings, seq_len=32, batch_size=4, eval_tokens=len(val), out_dir=tmp_path, parent=parent.ref())
        rows = run_settings(val=val, calib=calib, **kw)
        with pytest.raises(ValueError, match="calibrate on the training split"):
            run_settings(val=val, calib=val, **kw)
    assert [r["setting"] for r in rows] == ["rtn", "bcq@w2", "bcq@w3", "bcq@w4", "gptq"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bcq.safetensors", "gptq.safetensors", "rtn.safetensors"]
    by = {r["setting"]: r for r in rows}
    assert by["bcq@w2"]["ppl"] > by["bcq@w3"]["ppl"] > by["bcq@w4"]["ppl"] > by["rtn"]["ppl_fp"]
    assert by["rtn"]["bits_per_weight"] == 5.0 and by["gptq"]["calib_tokens"] == 512
    assert all(r["model"] == "tiny" and r["calib_eval_overlap"] == 0.0 for r in rows)
    assert all(math.isclose(r["ppl"], math.exp(r["val_loss"])) for r in rows)
    assert by["bcq@w2"]["bytes_on_disk"] == by["bcq@w4"]["bytes_on_disk"]  # one artifact


def test_a_pretrained_model_runs_as_one_job_on_the_prepared_text(tmp_path, smollm2_stand_in):
    """The stage's ``pretrained`` job (SmolLM2 in the demo) with a tiny Llama standing in for SmolLM2:
    calibrated on the prepared training text, scored on the validation text, one row per served width."""
    from flows.compress import compress_job
    from tasks.compression.config import CompressionConfig

    prepared = smollm2_stand_in
    cfg = CompressionConfig(settings={"rtn_w3": {"method": "rtn", "bits": 3, "group_size": 32},
                                      "bcq": {"method": "anybcq", "max_bits": 3, "group_size": 32, "seq_len": 32},
                                      "ladder_only": {"method": "rtn", "bits": 8, "group_size": 32}},
                            enabled=("ladder_only",), pretrained=("smollm2",), pretrained_settings=("rtn_w3", "bcq"),
                            pretrained_eval_tokens=256, pretrained_calib_tokens=512, pretrained_seq_len=32)
    with tracked_run("test-compress-pretrained", uri=os.environ["MLFLOW_TRACKING_URI"]) as parent:
        job = dict(name="smollm2", cfg=cfg, prepared=str(prepared), out_dir=str(tmp_path / "out"), parent=parent.ref())
        rows = compress_job.fn(kind="pretrained", job=job)
        alone = compress_job.fn(kind="pretrained", job=job | {"settings": ("bcq",), "out_dir": str(tmp_path / "bcq")})
    assert [r["setting"] for r in rows] == ["rtn_w3", "bcq@w2", "bcq@w3"]
    # the stage runs one job per setting: the same rows as the settings run together
    assert [(r["setting"], r["ppl"], r["ppl_fp"]) for r in alone] == [(r["setting"], r["ppl"], r["ppl_fp"]) for r in rows[1:]]
    assert {r["model"] for r in rows} == {"smollm2-135m"} and {r["variant"] for r in rows} == {"pretrained"}
    assert {r["calib_tokens"] for r in rows} == {512} and all(math.isfinite(r["ppl"]) for r in rows)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["bcq.safetensors", "rtn_w3.safetensors"]
