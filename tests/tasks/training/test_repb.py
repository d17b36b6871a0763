from __future__ import annotations

import numpy as np
import pytest
import torch
from training_fixtures import markov_tokens, tiny_config

from tasks.training.config import RePBConfig
from tasks.training.loop import ladder
from tasks.training.loop import run_fingerprint
from tasks.training.repb import RePBSelector, compare_repb, repb_arms


def test_keeps_top_fraction_of_the_window():
    sel = RePBSelector(RePBConfig(enabled=True, window=2, keep_ratio=0.5))
    keep, w = sel.select(np.array([4.0, 3.0, 2.0, 1.0]), np.arange(4))
    assert keep.tolist() == [True, True, False, False]
    # pool = previous batch (4,3,2,1) + this one; threshold = 4th largest of the 8 scores = 3.0
    keep, _ = sel.select(np.array([0.5, 0.6, 0.7, 5.0]), np.arange(4, 8))
    assert keep.tolist() == [False, False, False, True]  # an easy batch keeps fewer than half
    keep, _ = sel.select(np.array([9.0, 8.0, 7.0, 6.0]), np.arange(8, 12))
    assert keep.all()  # a hard batch keeps more (the window forgot the first batch)
    assert sel.kept_fraction == pytest.approx(7 / 12)


def test_at_least_one_sample_kept_and_unseen_weight_is_one():
    sel = RePBSelector(RePBConfig(enabled=True, window=1, keep_ratio=0.1))
    keep, w = sel.select(np.array([1.0, 1.0, 2.0]), np.array([7, 8, 9]))
    assert keep.tolist() == [False, False, True]
    assert w.tolist() == [0.0, 0.0, 1.0]  # never seen: frequency = keep_ratio, weight 1


def test_temporal_rescaling_follows_selection_history():
    cfg = RePBConfig(enabled=True, window=1, keep_ratio=0.5, prior=1.0, weight_min=0.1, weight_max=10.0)
    sel = RePBSelector(cfg)
    for _ in range(3):  # sample 0 always selected (hard), sample 1 never (easy)
        sel.select(np.array([5.0, 1.0]), np.array([0, 1]))
    f = sel.frequency(np.array([0, 1, 2]))
    assert f.tolist() == pytest.approx([(3 + 0.5) / 4, 0.5 / 4, 0.5])
    keep, w = sel.select(np.array([1.0, 5.0]), np.array([0, 1]))  # now the easy one is selected
    assert keep.tolist() == [False, True]
    assert w[1] == pytest.approx(0.5 / (0.5 / 4))  # rarely selected -> up-weighted (4x)
    clipped = RePBSelector(RePBConfig(enabled=True, window=1, keep_ratio=0.5))
    for _ in range(3):
        clipped.select(np.array([5.0, 1.0]), np.array([0, 1]))
    assert clipped.select(np.array([1.0, 5.0]), np.array([0, 1]))[1][1] == 2.0  # weight_max


def test_weighted_loss_is_mean_over_kept_and_differentiable():
    sel = RePBSelector(RePBConfig(enabled=True, window=1, keep_ratio=0.5))
    per_sample = torch.tensor([1.0, 3.0, 2.0, 4.0], requires_grad=True)
    loss = sel.weighted_loss(per_sample, np.arange(4))
    assert loss.item() == pytest.approx((3.0 + 4.0) / 2)
    loss.backward()
    assert per_sample.grad.tolist() == [0.0, 0.5, 0.0, 0.5]


def test_state_roundtrip():
    cfg = RePBConfig(enabled=True, window=3, keep_ratio=0.5)
    a = RePBSelector(cfg)
    rng = np.random.default_rng(0)
    for step in range(5):
        a.select(rng.random(4), rng.integers(0, 6, 4))
    b = RePBSelector(cfg)
    b.load_state(a.state_tensors(), a.state_scalars())
    scores, ids = rng.random(4), rng.integers(0, 6, 4)
    ka, wa = a.select(scores, ids)
    kb, wb = b.select(scores, ids)
    assert np.array_equal(ka, kb) and np.array_equal(wa, wb) and a.kept_fraction == b.kept_fraction


def test_compare_at_equal_steps(tmp_path):
    data = markov_tokens(60_000)
    cfg = tiny_config(repb=RePBConfig(window=4, keep_ratio=0.5))
    out = compare_repb(ladder(cfg)[0], cfg, data[:50_000], data[50_000:], tmp_path)
    base, pruned = out["baseline"], out["repb"]
    assert base.steps == pruned.steps and base.tokens == pruned.tokens
    assert base.repb_kept_frac is None and 0.4 < out["kept_fraction"] < 0.7
    assert pruned.val_loss != base.val_loss  # the pruning changed the updates...
    assert pruned.val_loss < pruned.history[0][1]  # ...and the pruned run still learns
    assert out["delta_val_loss"] == pytest.approx(pruned.val_loss - base.val_loss)


def test_arms_differ_only_in_pruning_and_reuse_the_plain_run():
    plain = tiny_config()
    assert repb_arms(plain, "raw") == [("", plain)]
    cfg = tiny_config(repb=RePBConfig(compare=("raw",), keep_ratio=0.5))
    assert repb_arms(cfg, "c4") == [("", cfg)]  # not compared: one arm, as configured
    (base_suffix, base), (repb_suffix, pruned) = repb_arms(cfg, "raw")
    assert (base_suffix, repb_suffix) == ("", "+repb")
    assert not base.repb.enabled and pruned.repb.enabled and pruned.repb.keep_ratio == 0.5
    assert not base.repb.compare and not pruned.repb.compare
    spec = ladder(cfg)[0]
    # The unpruned arm is the same run as one trained without compare: its result is reused.
    assert run_fingerprint(spec, base) == run_fingerprint(spec, tiny_config(repb=RePBConfig(keep_ratio=0.5)))
    assert run_fingerprint(spec, pruned) != run_fingerprint(spec, base)


def test_enabled_and_compare_are_exclusive():
    with pytest.raises(ValueError, match="repb.compare"):
        RePBConfig(enabled=True, compare=("raw",))
    with pytest.raises(ValueError, match="duplicates"):
        RePBConfig(compare=("raw", "raw"))
