"""The feasibility check before training: a variant that kept almost nothing is named under each mode,
a short one keeps the points its data allows (shrink), and a ladder can be sized to the data."""

from __future__ import annotations

import dataclasses

import pytest

from tasks.training.config import FeasibilityConfig, TrainingConfig
from tasks.lm.model import ModelShape
from tasks.training.design import ladder
from tasks.training.feasibility import (
    FAILED, OK, SHRUNK, SKIPPED, WindowNeed, check_feasibility, sized_to_data, trainable_tokens, validation_shortfall,
)
from tasks.training.loop import WindowSampler
from tasks.training.plan import ladder_cost, series_plans

CFG = TrainingConfig(
    vocab_size=300, seq_len=32, batch_size=4, warmup_steps=1, schedule="wsd", token_budgets=(1024, 2048, 4096),
    sizes=(ModelShape(d_model=16, n_layers=1, n_heads=2), ModelShape(d_model=32, n_layers=1, n_heads=2)),
)
PRUNE = WindowNeed(stage="prune", tokens=3000, what="pruning.calib_tokens 1,000 + pruning.recovery.tokens 2,000",
                   keys=("pruning.calib_tokens", "pruning.recovery.tokens", "pruning.variants"), series=("raw", "mid"))
# raw holds every point; mid (2,464 trainable of 2,500 tokens) the 1024 and 2048 points, not prune's 3,000;
# tiny not one window
TOKENS = {"raw": 50_000, "mid": 2_500, "tiny": 40}


def check(mode: str, tokens=TOKENS, needs=(PRUNE,), **kw):
    cfg = dataclasses.replace(CFG, feasibility=FeasibilityConfig(mode=mode, **kw))
    return check_feasibility(cfg, ladder(cfg), tokens, needs)


def rows(feas, variant):
    return {c.stage: c for c in feas.checks if c.variant == variant}


@pytest.mark.parametrize("n", [64, 65, 100, 1000, 4097])
def test_trainable_tokens_are_the_windows_the_sampler_draws(n):
    assert trainable_tokens(n, 32) == WindowSampler(n, 32, seed=0).n_windows * 32
    assert trainable_tokens(63, 32) == 0  # the sampler refuses this stream


def test_shrink_keeps_the_points_that_fit_and_leaves_the_short_variant_out_of_prune_only():
    feas = check("shrink")
    raw, mid, tiny = rows(feas, "raw"), rows(feas, "mid"), rows(feas, "tiny")
    assert raw["train"].status == OK and raw["prune"].status == OK
    assert [s.name for s in feas.ladders["raw"]] == [s.name for s in ladder(CFG)]
    # mid: 2,464 trainable tokens hold D = 1024 and 2048, not 4096
    assert mid["train"].status == SHRUNK and {s.tokens for s in feas.ladders["mid"]} == {1024, 2048}
    assert "d32_l1_D4096" in mid["train"].reason and "4 of 6 points kept" in mid["train"].reason
    assert mid["prune"].status == SKIPPED and "2,500 training tokens, needs 3,000" in mid["prune"].reason
    assert "pruning.recovery.tokens" in mid["prune"].keys
    # tiny: not one point; out of training (and not in prune's filter, so no prune row)
    assert tiny["train"].status == SKIPPED and "tiny" not in feas.ladders and "prune" not in tiny
    assert "training.token_budgets" in tiny["train"].keys and "training.feasibility.max_epochs" in tiny["train"].keys
    assert feas.trained == ["raw", "mid"] and not feas.failed


def test_skip_leaves_every_short_variant_out_of_everything():
    feas = check("skip")
    assert feas.trained == ["raw"]
    mid = rows(feas, "mid")
    assert mid["train"].status == SKIPPED and mid["prune"].status == SKIPPED
    assert rows(feas, "tiny")["train"].status == SKIPPED
    # a variant whose ladder fits but prune's windows do not is skipped too, saying why
    only_prune = check("skip", tokens={"raw": 50_000, "short": 2_900}, needs=(dataclasses.replace(PRUNE, series=()),),
                       max_epochs=2.0)
    short = rows(only_prune, "short")
    assert short["train"].status == SKIPPED and short["train"].reason.startswith("cannot serve prune")


def test_fail_names_each_variant_its_tokens_and_the_keys_and_trains_nothing():
    feas = check("fail")
    assert feas.ladders == {} and {c.variant for c in feas.failed} == {"mid", "tiny"}
    msg = feas.message()
    assert "mid: train:" in msg and "mid: prune: 2,500 training tokens, needs 3,000" in msg and "tiny: train:" in msg
    assert "training.token_budgets" in msg and "pruning.calib_tokens" in msg
    assert check("fail", tokens={"raw": 50_000}).failed == []  # nothing short: nothing fails
    assert all(c.status == FAILED for c in feas.failed)


def test_max_epochs_lets_points_repeat_data_and_the_plan_lists_them():
    feas = check("shrink", max_epochs=2.0)
    assert rows(feas, "mid")["train"].status == OK  # 4096 <= 2 x 2,432
    plans = series_plans(CFG, ladder(CFG), ["mid"], tokens={"mid": 2_500}, ladders=feas.ladders,
                         statuses={"mid": "ok"})
    assert sorted(n for n, _ in plans[0].repeats) == ["d16_l1_D4096", "d32_l1_D4096"]
    assert all(1.6 < e < 1.7 for _, e in plans[0].repeats)


def test_a_need_applies_to_the_series_in_its_stage_filter_only():
    need = dataclasses.replace(PRUNE, series=("raw+repb",))
    cfg = dataclasses.replace(CFG, repb=dataclasses.replace(CFG.repb, compare=("raw",)))
    feas = check_feasibility(cfg, ladder(cfg), {"raw": 2_000, "other": 2_000}, [need])
    assert rows(feas, "raw")["prune"].status == SKIPPED and "prune" not in rows(feas, "other")
    assert rows(feas, "raw")["train"].series == ("raw", "raw+repb")


def test_validation_split_shorter_than_one_window_is_named():
    assert validation_shortfall(33, 32) is None
    assert "prepare.val_fraction" in validation_shortfall(20, 32)


@pytest.mark.parametrize("design", ["grid", "isoflop"])
def test_sized_to_data_puts_the_largest_d_at_max_epochs_of_the_smallest_variant(design):
    cfg = CFG if design == "grid" else dataclasses.replace(CFG, token_budgets=(), compute_budgets=(1e9, 3e9),
                                                          sizes_per_budget=2)
    tokens = {"raw": 200_000, "small": 20_000}
    sized, factor = sized_to_data(cfg, tokens)
    target = trainable_tokens(20_000, cfg.seq_len)
    largest = max(s.tokens_trained for s in ladder(sized))
    assert largest <= target and largest > 0.9 * target
    assert check_feasibility(sized, ladder(sized), tokens).problems == []
    with pytest.raises(ValueError, match="size_to_data"):
        sized_to_data(cfg, {"raw": 100})


def test_ladder_cost_counts_wsd_stable_runs_once():
    specs = ladder(CFG)
    wsd = {c.size: c.steps for c in ladder_cost(CFG, specs)}
    # one stable run to the last branch point (4096-token point: 32 steps, cooldown from step 26) + 3 cooldowns
    by = [s for s in specs if s.size == "d16_l1"]
    assert wsd["d16_l1"] == max(s.decay_start for s in by) + sum(s.steps - s.decay_start for s in by) < sum(s.steps for s in by)
    cosine = dataclasses.replace(CFG, schedule="cosine", warmup_steps=None)
    assert {c.size: c.steps for c in ladder_cost(cosine, ladder(cosine))}["d16_l1"] == sum(s.steps for s in by)
