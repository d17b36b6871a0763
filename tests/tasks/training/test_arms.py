"""The arms a variant trains as: plain, +repb (repb.compare) and +<other arch> (arch_compare)."""

from __future__ import annotations

import dataclasses

from training_fixtures import tiny_config

from tasks.training.arms import training_arms
from tasks.training.config import RePBConfig
from tasks.training.design import arch_specs, ladder
from tasks.training.repb import repb_arms


def test_training_arms_keep_repb_arms_and_add_the_other_architecture():
    cfg = tiny_config(repb=RePBConfig(compare=("raw",)), arch_compare=("raw", "c4"))
    arms = training_arms(cfg, "raw")
    assert [s for s, _ in arms] == ["", "+repb", "+xlstm"]
    assert arms[:2] == repb_arms(cfg, "raw")  # RePB's labels and configs unchanged
    plain, xlstm = arms[0][1], arms[2][1]
    assert xlstm.arch == "xlstm" and not xlstm.repb.enabled
    assert dataclasses.replace(xlstm, arch="llama", arch_compare=plain.arch_compare) == plain  # only the arch differs
    assert [s for s, _ in training_arms(cfg, "c4")] == ["", "+xlstm"]
    assert training_arms(cfg, "other") == [("", cfg)]
    back = tiny_config(arch="xlstm", arch_compare=("raw",))
    assert [(s, c.arch) for s, c in training_arms(back, "raw")] == [("", "xlstm"), ("+llama", "llama")]


def test_arch_specs_train_the_same_points_counted_for_their_architecture():
    cfg = tiny_config(token_budgets=(2048, 4096), schedule="wsd", warmup_steps=2)
    specs = ladder(cfg)
    other = arch_specs(specs, dataclasses.replace(cfg, arch="xlstm"))
    same = ("name", "size", "tokens", "steps", "decay_start", "warmup_steps", "lr", "compute_budget", "point")
    assert [[getattr(s, k) for k in same] for s in other] == [[getattr(s, k) for k in same] for s in specs]
    assert all(o.n_params_total != s.n_params_total and o.flops_per_token != s.flops_per_token
               for o, s in zip(other, specs))
