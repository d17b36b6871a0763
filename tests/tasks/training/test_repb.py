from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from training_fixtures import markov_tokens, tiny_config

from tasks.training.config import RePBConfig
from tasks.lm.model import ModelShape
from tasks.training.loop import run_fingerprint, train_model
from tasks.training.design import ladder
from tasks.training.repb import RePBSelector, normalise_scores, repb_arms, weighted_step_loss


def _raw(**kw) -> RePBConfig:
    """Raw-loss pool and per-sample frequencies: the plain rules, easy to follow by hand."""
    return RePBConfig(enabled=True, score_norm="none", frequency_regions=0, **kw)


def test_keeps_top_fraction_of_the_window():
    sel = RePBSelector(_raw(window=2, keep_ratio=0.5))
    keep, w = sel.select(np.array([4.0, 3.0, 2.0, 1.0]), np.arange(4))
    assert keep.tolist() == [True, True, False, False]
    # pool = previous step (4,3,2,1) + this one; threshold = 4th largest of the 8 scores = 3.0
    keep, _ = sel.select(np.array([0.5, 0.6, 0.7, 5.0]), np.arange(4, 8))
    assert keep.tolist() == [False, False, False, True]  # an easy step keeps fewer than half
    keep, _ = sel.select(np.array([9.0, 8.0, 7.0, 6.0]), np.arange(8, 12))
    assert keep.all()  # a hard step keeps more (the window forgot the first step)
    assert sel.kept_fraction == pytest.approx(7 / 12)


def test_normalised_pool_ignores_the_loss_level_but_not_the_tail():
    sel = RePBSelector(RePBConfig(enabled=True, window=2, keep_ratio=0.5), n_samples=12)
    sel.select(np.array([4.0, 3.0, 2.0, 1.0]), np.arange(4))
    # the same shape 3 nats lower: as hard as the last step once the level is removed
    keep, _ = sel.select(np.array([1.0, 0.0, -1.0, -2.0]), np.arange(4, 8))
    assert keep.tolist() == [True, True, False, False]
    # one outlier far above the rest: only it clears the pooled threshold
    keep, _ = sel.select(np.array([0.0, 0.1, 0.2, 5.0]), np.arange(8, 12))
    assert keep.tolist() == [False, False, False, True]


@pytest.mark.parametrize("how", ["zscore", "center", "rank", "none"])
def test_normalise_scores(how):
    z = normalise_scores(np.array([3.0, 1.0, 2.0, 2.0, 7.0]), how)
    expected = {
        "zscore": (np.array([3.0, 1.0, 2.0, 2.0, 7.0]) - 3.0) / np.std([3.0, 1.0, 2.0, 2.0, 7.0]),
        "center": np.array([0.0, -2.0, -1.0, -1.0, 4.0]),
        "rank": np.array([3.0, 0.0, 1.5, 1.5, 4.0]) / 4,  # the tied pair shares rank 1.5
        "none": np.array([3.0, 1.0, 2.0, 2.0, 7.0]),
    }[how]
    assert z == pytest.approx(expected)
    assert np.all(np.isfinite(normalise_scores(np.full(3, 2.0), how)))  # no 0/0 on a flat step
    assert np.all(np.isfinite(normalise_scores(np.array([2.0]), how)))


def test_at_least_one_sample_kept_and_unseen_weight_is_one():
    sel = RePBSelector(RePBConfig(enabled=True, window=1, keep_ratio=0.1), n_samples=10)
    keep, w = sel.select(np.array([1.0, 1.0, 2.0]), np.array([7, 8, 9]))
    assert keep.tolist() == [False, False, True]
    assert w.tolist() == [0.0, 0.0, 1.0]  # never seen: frequency = keep_ratio, weight 1


def test_temporal_rescaling_follows_selection_history():
    cfg = _raw(window=1, keep_ratio=0.5, prior=1.0, weight_min=0.1, weight_max=10.0)
    sel = RePBSelector(cfg)
    for _ in range(3):  # sample 0 always selected (hard), sample 1 never (easy)
        sel.select(np.array([5.0, 1.0]), np.array([0, 1]))
    f = sel.frequency(np.array([0, 1, 2]))
    assert f.tolist() == pytest.approx([(3 + 0.5) / 4, 0.5 / 4, 0.5])
    keep, w = sel.select(np.array([1.0, 5.0]), np.array([0, 1]))  # now the easy one is selected
    assert keep.tolist() == [False, True]
    assert w[1] == pytest.approx(0.5 / (0.5 / 4))  # rarely selected -> up-weighted (4x)
    clipped = RePBSelector(_raw(window=1, keep_ratio=0.5))
    for _ in range(3):
        clipped.select(np.array([5.0, 1.0]), np.array([0, 1]))
    assert clipped.select(np.array([1.0, 5.0]), np.array([0, 1]))[1][1] == 2.0  # weight_max


def _single_epoch_skewed(cfg: RePBConfig, n_samples: int = 1024, batch: int = 16, seed: int = 0):
    """One epoch (every id once) where region r of 8 has loss ~ 0.5 r + noise: low regions are easy."""
    rng = np.random.default_rng(seed)
    sel = RePBSelector(cfg, n_samples=n_samples)
    ids = rng.permutation(n_samples)
    region, weights = [], []
    for start in range(0, n_samples, batch):
        b = ids[start:start + batch]
        r = b * 8 // n_samples
        keep, w = sel.select(0.5 * r + rng.normal(0, 1.0, len(b)), b)
        region.append(r[keep])
        weights.append(w[keep])
    return np.concatenate(region), np.concatenate(weights)


def test_rescaling_acts_within_one_epoch():
    region, w = _single_epoch_skewed(RePBConfig(enabled=True, keep_ratio=0.7, frequency_regions=8))
    assert np.mean(w != 1.0) > 0.9  # after the first visits every region has a history
    # the easy regions the selection passes over count more when kept; the hard ones less
    assert w[region <= 1].mean() > 1.1 and w[region >= 6].mean() < 0.95
    # the paper's per-sample frequency: in one epoch every sample is new, every weight exactly 1
    _, w_sample = _single_epoch_skewed(RePBConfig(enabled=True, keep_ratio=0.7, frequency_regions=0))
    assert np.all(w_sample == 1.0)


@pytest.mark.parametrize("how", ["zscore", "center", "rank"])
def test_kept_fraction_tracks_keep_ratio_while_loss_falls(how):
    rng = np.random.default_rng(1)
    cfg = RePBConfig(enabled=True, window=8, keep_ratio=0.7, score_norm=how, frequency_regions=0)
    sel = RePBSelector(cfg)
    raw = RePBSelector(dataclasses.replace(cfg, score_norm="none"))
    for t in range(200):  # the loss falls by 0.05 nats a step, 8x the noise over the window
        scores = 6.0 - 0.05 * t + rng.normal(0, 0.1, 20)
        ids = np.arange(20 * t, 20 * (t + 1))
        sel.select(scores, ids)
        raw.select(scores, ids)
    assert abs(sel.kept_fraction - 0.7) <= 0.05
    if how == "rank":  # every step's ranks are the same set: exactly ceil(keep_ratio * B) per step
        assert sel.kept_fraction == pytest.approx(14 / 20)
    assert raw.kept_fraction < 0.5  # the raw pool: older steps look harder, the current keeps too few


def test_selection_is_over_the_whole_step_with_accumulation():
    cfg = RePBConfig(enabled=True, window=1, keep_ratio=0.5, score_norm="none", frequency_regions=0)
    hard, easy = np.array([5.0, 6.0, 7.0, 8.0]), np.array([1.0, 2.0, 3.0, 4.0])
    keep, w = RePBSelector(cfg).select(np.concatenate([hard, easy]), np.arange(8))
    assert keep.tolist() == [True] * 4 + [False] * 4  # the step's top half, all in micro-batch 0
    # per micro-batch the easy one would keep half of itself
    assert RePBSelector(cfg).select(easy, np.arange(4, 8))[0].sum() == 2


def test_micro_batch_losses_sum_to_the_step_loss():
    rng = np.random.default_rng(0)
    b, accum = 5, 3
    losses = torch.tensor(rng.random(b * accum) * 4, requires_grad=True)
    keep = rng.random(b * accum) < 0.6
    weight = np.where(keep, rng.uniform(0.5, 2.0, b * accum), 0.0)
    n_kept = int(keep.sum())
    total = sum(weighted_step_loss(losses[m * b:(m + 1) * b], weight[m * b:(m + 1) * b], n_kept)
                for m in range(accum))
    expected = (keep * weight * losses.detach().numpy()).sum() / keep.sum()
    assert total.item() == pytest.approx(expected)
    total.backward()
    assert losses.grad.numpy() == pytest.approx(keep * weight / keep.sum())


def test_weighted_loss_is_mean_over_kept_and_differentiable():
    sel = RePBSelector(_raw(window=1, keep_ratio=0.5))
    per_sample = torch.tensor([1.0, 3.0, 2.0, 4.0], requires_grad=True)
    loss = sel.weighted_loss(per_sample, np.arange(4))
    assert loss.item() == pytest.approx((3.0 + 4.0) / 2)
    loss.backward()
    assert per_sample.grad.tolist() == [0.0, 0.5, 0.0, 0.5]


@pytest.mark.parametrize("regions", [0, 4], ids=["per-sample", "regions"])
def test_state_roundtrip(regions):
    cfg = RePBConfig(enabled=True, window=3, keep_ratio=0.5, frequency_regions=regions)
    a = RePBSelector(cfg, n_samples=6)
    rng = np.random.default_rng(0)
    for size in (4, 5, 3, 4, 6):  # steps of different sizes (the pool stores them flat)
        a.select(rng.random(size), rng.integers(0, 6, size))
    b = RePBSelector(cfg, n_samples=6)
    b.load_state(a.state_tensors(), a.state_scalars())
    scores, ids = rng.random(4), rng.integers(0, 6, 4)
    ka, wa = a.select(scores, ids)
    kb, wb = b.select(scores, ids)
    assert np.array_equal(ka, kb) and np.array_equal(wa, wb) and a.kept_fraction == b.kept_fraction
    with pytest.raises(ValueError, match="n_samples"):  # regions of another corpus size
        RePBSelector(cfg, n_samples=7).load_state(a.state_tensors(), a.state_scalars())


def test_regions_need_n_samples():
    with pytest.warns(UserWarning, match="n_samples"):
        sel = RePBSelector(RePBConfig(enabled=True, frequency_regions=4))
    assert sel.regions == 0
    with pytest.raises(ValueError, match="n_samples"):
        RePBSelector(RePBConfig(enabled=True, frequency_regions=4), n_samples=8).select(np.ones(2), np.array([0, 8]))


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_training_run_keeps_keep_ratio(tmp_path, grad_accum):
    """A tiny real run: the loss falls fast in 30 steps, yet about keep_ratio of the data is kept."""
    data = markov_tokens(40_000)
    cfg = tiny_config(vocab_size=300, sizes=(ModelShape(d_model=16, n_layers=1, n_heads=2),),
                      batch_size=8 // grad_accum, grad_accum=grad_accum, token_budgets=(30 * 8 * 32,),
                      eval_interval=30, log_interval=10,
                      repb=RePBConfig(enabled=True, keep_ratio=0.7, window=8))
    spec = ladder(cfg)[0]
    assert spec.steps == 30
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # until the loop passes n_samples
        result = train_model(spec, cfg, data[:35_000], data[35_000:], tmp_path)
    assert abs(result.repb_kept_frac - 0.7) <= 0.05
    assert result.history[-1][1] < result.history[0][1]  # and it learns


def compare_repb(spec, cfg, train_tokens: np.ndarray, val_tokens: np.ndarray, out_dir: Path) -> dict:
    """Train ``spec`` twice at equal optimizer steps, without and with RePB (the two arms
    :func:`repb_arms` gives a compared variant); return both results, the val-loss delta and the
    RePB run's kept fraction. Runs go to ``out_dir/baseline`` and ``out_dir/repb``."""
    compared = dataclasses.replace(cfg, repb=dataclasses.replace(cfg.repb, compare=("raw",)))
    (_, base_cfg), (_, repb_cfg) = repb_arms(compared, "raw")
    base = train_model(spec, base_cfg, train_tokens, val_tokens, out_dir / "baseline")
    pruned = train_model(spec, repb_cfg, train_tokens, val_tokens, out_dir / "repb")
    return {
        "baseline": base,
        "repb": pruned,
        "delta_val_loss": pruned.val_loss - base.val_loss,
        "kept_fraction": pruned.repb_kept_frac,
    }


def test_compare_at_equal_steps(tmp_path):
    data = markov_tokens(60_000)
    cfg = tiny_config(repb=RePBConfig(window=4, keep_ratio=0.5))
    out = compare_repb(ladder(cfg)[0], cfg, data[:50_000], data[50_000:], tmp_path)
    base, pruned = out["baseline"], out["repb"]
    assert base.steps == pruned.steps and base.tokens == pruned.tokens
    assert base.repb_kept_frac is None and abs(out["kept_fraction"] - 0.5) <= 0.05
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
