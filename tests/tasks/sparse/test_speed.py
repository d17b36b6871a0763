"""tasks.sparse.speed: the sparse_eval stage's measured speed-ups (what is timed, and what is left alone)."""

from __future__ import annotations

import math

import pytest
import torch

from tasks.sparse.proxyattn import ProxyAttnConfig, proxyattn
from tasks.sparse.quoka import QuokaConfig, quoka
from tasks.sparse.registry import sparsify
from tasks.sparse.speed import attention_speedup, interleaved, linear_speedup, measured_speedup
from tasks.sparse.teal import TealConfig
from sparse_support import tiny_llama


def test_interleaved_times_each_candidate_and_calls_it_every_round():
    calls = {"a": 0, "b": 0}

    def bump(name):
        def run():
            calls[name] += 1
        return run

    times = interleaved({"a": bump("a"), "b": bump("b")}, rounds=3, repeats=2)
    assert set(times) == {"a", "b"} and all(t >= 0 for t in times.values())
    assert calls == {"a": 7, "b": 7}  # one warm-up, then 3 rounds of 2


@pytest.mark.parametrize("make", [lambda m: quoka(m, QuokaConfig(chunk_size=16), sparsity=0.5),
                                  lambda m: proxyattn(m, ProxyAttnConfig(block_size=8), sparsity=0.5)],
                         ids=["quoka", "proxyattn"])
def test_attention_speedup_times_the_handle_and_leaves_its_counts(make):
    model = tiny_llama()
    handle = make(model)
    handle.skipped, handle.visible = 3, 10
    s = attention_speedup(model, handle, 128, rounds=1)
    assert math.isfinite(s) and s > 0
    assert (handle.skipped, handle.visible) == (3, 10)


def test_measured_speedup_times_what_it_is_asked_to():
    model = tiny_llama()
    attention = quoka(model, QuokaConfig(chunk_size=16), sparsity=0.5)
    activation = sparsify(model, TealConfig(mode="topk"), sparsity=0.5)
    assert measured_speedup(model, attention, 0.5, 64, "none") is None
    assert measured_speedup(model, activation, 0.5, 64, "attention") is None
    assert measured_speedup(model, attention, 0.5, 64, "attention") > 0
    assert measured_speedup(model, activation, 0.0, 64, "all") is None  # nothing skipped, nothing to time
    assert linear_speedup(model, 0.5, rounds=1, repeats=2) > 0


def test_a_model_without_a_llama_mlp_is_refused_by_name():
    with pytest.raises(ValueError, match="Sequential: no Llama-family MLP"):
        linear_speedup(torch.nn.Sequential(torch.nn.Linear(4, 4)), 0.5)


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"speed": "fast"}, r"speed: expected one of all, attention, none"),
        ({"pretrained": ["llama-7b"]}, r"pretrained: unknown pretrained model\(s\) \['llama-7b'\]"),
        ({"pretrained_settings": ["nope"]}, r"pretrained_settings: names settings that are not defined: \['nope'\]"),
        ({"retrieval": {"lengths": [8]}}, r"retrieval: lengths: needs at least one length, each >= 64"),
        ({"retrieval": {"length": [1024]}}, r"retrieval: .*unexpected keyword argument 'length'"),
    ],
    ids=["speed", "pretrained", "pretrained_settings", "retrieval_value", "retrieval_key"],
)
def test_sparse_eval_config_errors_name_the_key(override, match):
    from tasks.sparse.registry import SparseEvalConfig

    with pytest.raises(ValueError, match=match):
        SparseEvalConfig(settings={"teal": {"method": "teal"}}, **override)


def test_demo_evaluates_smollm2_with_one_level_per_method_and_ci_does_not():
    from pathlib import Path

    from tasks.common.params import load_stage_config
    from tasks.sparse.registry import SparseEvalConfig

    root = Path(__file__).resolve().parents[3]
    demo = load_stage_config(SparseEvalConfig, root, "sparse_eval", "demo")
    assert demo.pretrained == ("smollm2",) and demo.retrieval
    assert {m for m, _ in demo.pretrained_methods().values()} == {"teal", "wina", "quoka", "proxyattn"}
    assert all(len(c.sparsities) == 1 for _, c in demo.pretrained_methods().values())
    assert load_stage_config(SparseEvalConfig, root, "sparse_eval", "ci").pretrained == ()
