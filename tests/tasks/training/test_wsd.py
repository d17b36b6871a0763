"""WSD schedule, cooldown branches from a stable run, and the IsoFLOP design."""

from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from training_fixtures import markov_tokens, tiny_config

from tasks.lm.model import ModelShape
from tasks.training.design import isoflop_points, ladder, lr_at, stable_steps
from tasks.training.loop import DOC_LOSSES_FILE, read_doc_losses, train_model, train_size_wsd
from tasks.lm.model import model_flops_per_token

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def data():
    d = markov_tokens(60_000)
    return d[:50_000], d[50_000:]


def wsd_config(**overrides):
    base = dict(schedule="wsd", token_budgets=(2048, 4096), cooldown_frac=0.25, warmup_steps=2, lr=3e-3,
                eval_interval=8, checkpoint_interval=4)
    return tiny_config(**(base | overrides))


def test_wsd_lr_values_and_branch_points():
    cfg = wsd_config(token_budgets=(1280, 2560), cooldown_frac=0.2, warmup_steps=2)
    short, long = ladder(cfg)  # 10 and 20 steps of 128 tokens
    assert (short.steps, long.steps) == (10, 20)
    assert (short.decay_start, long.decay_start) == (8, 16) and stable_steps([short, long]) == [8, 16]
    lrs = [lr_at(s, long, cfg) for s in range(20)]
    assert lrs[:2] == pytest.approx([1.5e-3, 3e-3])  # linear warmup over 2 steps
    assert lrs[2:16] == pytest.approx([3e-3] * 14)  # stable
    assert lrs[16:] == pytest.approx([3e-3 * (1 - (k + 0.5) / 4) for k in range(4)])  # linear to 0
    # every budget shares the stable phase: the short run's lr equals the long run's before its cooldown
    assert [lr_at(s, short, cfg) for s in range(8)] == lrs[:8]
    sq = dataclasses.replace(cfg, cooldown_shape="1-sqrt")
    assert lr_at(17, long, sq) == pytest.approx(3e-3 * (1 - math.sqrt(1.5 / 4)))
    with pytest.raises(ValueError, match="warmup_steps"):
        ladder(dataclasses.replace(cfg, warmup_steps=9))


def test_branch_equals_a_standalone_wsd_run(data, tmp_path):
    """A cooldown branch off the stable run is the run that would have been trained alone."""
    cfg = wsd_config()
    specs = ladder(cfg)
    results = train_size_wsd(specs, cfg, *data, [tmp_path / s.name for s in specs], tmp_path / "stable")
    alone = train_model(specs[0], cfg, *data, tmp_path / "alone")
    assert results[0].val_loss == pytest.approx(alone.val_loss, rel=1e-6)
    assert results[0].shared_steps == specs[0].decay_start and results[0].schedule == "wsd"
    assert results[1].val_loss < results[0].val_loss  # more tokens, lower loss
    assert not (tmp_path / "stable" / "branches").exists()  # removed once every branch is done
    # a rerun finds every result and trains nothing
    again = train_size_wsd(specs, cfg, *data, [tmp_path / s.name for s in specs], tmp_path / "stable",
                           progress=lambda spec: (lambda s, n: pytest.fail("trained again")))
    assert [r.val_loss for r in again] == [r.val_loss for r in results]


_KILLED_CHILD = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
    from training_fixtures import markov_tokens, tiny_config
    from tasks.training.design import ladder
    from tasks.training.loop import train_size_wsd
    cfg = tiny_config(schedule="wsd", token_budgets=(2048, 4096), cooldown_frac=0.25, warmup_steps=2, lr=3e-3,
                      eval_interval=8, checkpoint_interval=4)
    specs = ladder(cfg)
    d = markov_tokens(60_000)
    out = sys.argv[1]
    kill_at = (sys.argv[2], int(sys.argv[3]))   # (which spec's progress, step)

    def progress(spec):
        def cb(step, total):
            if spec.name == kill_at[0] and step == kill_at[1]:
                os.kill(os.getpid(), signal.SIGKILL)
        return cb

    train_size_wsd(specs, cfg, d[:50_000], d[50_000:], [f"{{out}}/{{s.name}}" for s in specs], f"{{out}}/stable",
                   progress=progress)
""")


@pytest.mark.parametrize("where", ["stable", "branch"])
def test_killed_stable_run_or_branch_resumes_to_the_same_loss(data, tmp_path, where):
    import subprocess

    cfg = wsd_config()
    specs = ladder(cfg)
    reference = train_size_wsd(specs, cfg, *data, [tmp_path / "ref" / s.name for s in specs], tmp_path / "ref" / "stable")
    script = tmp_path / "child.py"
    script.write_text(_KILLED_CHILD.format(root=str(ROOT), tests=str(Path(__file__).parent)))
    out = tmp_path / "killed"
    # stable run: its progress is reported under the longest spec while steps < its decay_start;
    # branch: the long budget's cooldown (steps 24..31), after its step-28 checkpoint
    name, step = (specs[1].name, 10) if where == "stable" else (specs[1].name, 30)
    proc = subprocess.run([sys.executable, str(script), str(out), name, str(step)], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert not (out / specs[1].name / "result.json").exists()
    resumed = train_size_wsd(specs, cfg, *data, [out / s.name for s in specs], out / "stable")
    assert [r.val_loss for r in resumed] == pytest.approx([r.val_loss for r in reference], rel=1e-6)


def test_isoflop_design_trains_d_equal_c_over_flops_per_token():
    sizes = tuple(ModelShape(d_model=d, n_layers=1, n_heads=2) for d in (16, 32, 64, 128))
    cfg = tiny_config(token_budgets=(), compute_budgets=(1e10, 1e11), sizes_per_budget=3, sizes=sizes,
                      tokens_per_param_guess=20.0)
    points = isoflop_points(cfg)
    assert len(points) == 6
    for shape, tokens, c in points:
        f = model_flops_per_token(shape, cfg.seq_len, cfg.vocab_size).total
        assert tokens == round(c / f)  # D = C / flops_per_token(N), i.e. C / 6N up to attention
    from tasks.lm.model import parameter_counts

    widths = [16, 32, 64, 128]
    for c in (1e10, 1e11):
        chosen = [s.d_model for s, _, cc in points if cc == c]
        tpp = [c / model_flops_per_token(s, cfg.seq_len, cfg.vocab_size).total
               / parameter_counts(s, cfg.vocab_size, seq_len=cfg.seq_len).total for s in sizes]
        best = widths[int(np.argmin(np.abs(np.log(np.array(tpp) / 20.0))))]
        i = widths.index(chosen[0])
        assert chosen == widths[i:i + 3] and best in chosen  # 3 consecutive sizes around ~20 tokens/param
        if best not in (widths[0], widths[-1]):
            assert chosen[1] == best
    specs = ladder(cfg)
    assert {s.compute_budget for s in specs} == {1e10, 1e11}
    for s in specs:
        assert s.flops_per_token * s.tokens == pytest.approx(s.compute_budget, rel=1e-3)


def test_largest_model_beats_smallest_at_equal_compute(tmp_path):
    """On a small fixed IsoFLOP ladder (one budget, a 4x wider model on ~6x fewer tokens), the
    larger model reaches the lower loss: the ladder is long enough for size to pay at equal compute."""
    data = markov_tokens(1_400_000, seed=1)
    train, val = data[:1_350_000], data[1_350_000:]
    sizes = (ModelShape(d_model=8, n_layers=1, n_heads=2), ModelShape(d_model=32, n_layers=1, n_heads=2))
    cfg = tiny_config(sizes=sizes, token_budgets=(), compute_budgets=(4e10,), sizes_per_budget=2,
                      schedule="wsd", warmup_steps=5, batch_size=16, lr=1.2e-2, lr_ref_width=8,
                      lr_width_exponent=0.5, eval_interval=10**6, eval_tokens=8192, log_interval=10**6)
    small, large = ladder(cfg)
    assert small.compute_budget == large.compute_budget and small.n_params_total < large.n_params_total
    assert small.flops_per_token * small.tokens == pytest.approx(large.flops_per_token * large.tokens, rel=1e-2)
    assert small.tokens_trained <= len(train) and large.tokens < small.tokens
    r_small = train_size_wsd([small], cfg, train, val, [tmp_path / "s"], tmp_path / "s-stable")[0]
    r_large = train_size_wsd([large], cfg, train, val, [tmp_path / "l"], tmp_path / "l-stable")[0]
    assert r_large.val_loss < r_small.val_loss - 0.02, (r_small.val_loss, r_large.val_loss)


def test_every_wsd_point_writes_doc_losses_and_a_rerun_reuses_them(data, tmp_path):
    cfg = wsd_config()
    specs = ladder(cfg)
    docs = (np.arange(len(data[1])) // 250).astype(np.int32)
    outs = [tmp_path / s.name for s in specs]
    results = train_size_wsd(specs, cfg, *data, outs, tmp_path / "stable", val_docs=docs)
    written = {}
    for out, r in zip(outs, results):
        table = read_doc_losses(out)
        assert len(table) == 40 and table["tokens"].sum() == r.val_tokens
        assert table["loss_sum"].sum() / table["tokens"].sum() == pytest.approx(r.val_loss, rel=1e-12)
        written[out] = (out / DOC_LOSSES_FILE).stat().st_mtime_ns
    again = train_size_wsd(specs, cfg, *data, outs, tmp_path / "stable", val_docs=docs,
                           progress=lambda spec: (lambda s, n: pytest.fail("trained again")))
    assert again == results
    assert {out: (out / DOC_LOSSES_FILE).stat().st_mtime_ns for out in outs} == written  # not rewritten

    # A folder from before the full-split scoring (no doc_losses.parquet, no val_tokens, the curve's
    # val_loss) is rescored from its weights, not retrained, and ends where a fresh run would.
    before = read_doc_losses(outs[0])
    old = outs[0] / "result.json"
    stored = json.loads(old.read_text())
    old.write_text(json.dumps({k: v for k, v in stored.items() if k != "val_tokens"} | {"val_loss": 9.9}))
    (outs[0] / DOC_LOSSES_FILE).unlink()
    rescored = train_size_wsd(specs, cfg, *data, outs, tmp_path / "stable", val_docs=docs,
                              progress=lambda spec: (lambda s, n: pytest.fail("trained again")))
    assert rescored[0].val_loss == pytest.approx(results[0].val_loss, rel=1e-12)
    assert rescored[0].val_tokens == results[0].val_tokens
    after = read_doc_losses(outs[0])
    assert after["doc"].to_list() == before["doc"].to_list() and after["tokens"].to_list() == before["tokens"].to_list()
    assert after["loss_sum"].to_list() == pytest.approx(before["loss_sum"].to_list(), rel=1e-12)
    assert json.loads(old.read_text())["val_loss"] == rescored[0].val_loss


def test_extra_branches_add_anneal_points_from_the_stable_run_and_leave_the_ladder_alone():
    """``extra_branches``: per ladder point of D tokens, a cooldown branch at f * D tokens (its own
    decay_start), no compute_budget, ``point: anneal``; duplicates of existing points are skipped and
    the ladder's points are unchanged (the same specs and folder keys)."""
    cfg = wsd_config(token_budgets=(2560, 5120), cooldown_frac=0.2, warmup_steps=2)  # 20 and 40 steps of 128
    base = ladder(cfg)
    specs = ladder(dataclasses.replace(cfg, extra_branches=(0.25, 0.5)))
    ladder_points = [s for s in specs if s.point == "ladder"]
    assert ladder_points == base and [s.key() for s in ladder_points] == [s.key() for s in base]
    anneal = {s.name: s for s in specs if s.point == "anneal"}
    # 0.5 of 5120 is 2560, the ladder's own point: skipped; 0.25 of 5120 = 0.5 of 2560 = 1280: once
    assert sorted(anneal) == ["d32_l1_D1280", "d32_l1_D640"]
    a = anneal["d32_l1_D1280"]
    assert (a.steps, a.decay_start, a.warmup_steps, a.compute_budget, a.lr) == (10, 8, 2, None, base[0].lr)
    assert (anneal["d32_l1_D640"].steps, anneal["d32_l1_D640"].decay_start) == (5, 4)
    # every branch point lies on the one stable run, which still ends at the longest point's
    assert stable_steps(specs) == [4, 8, 16, 32] and max(s.steps for s in specs) == base[-1].steps
    assert [(s.n_params_total, s.tokens) for s in specs] == sorted((s.n_params_total, s.tokens) for s in specs)
    with pytest.raises(ValueError, match="extra_branches"):  # cooldown of a 1-step point inside a 2-step warmup
        ladder(dataclasses.replace(cfg, extra_branches=(0.05,)))


def test_extra_branches_anneal_point_is_trained_from_the_stable_run(data, tmp_path):
    """An anneal point trains as one more cooldown branch of its size; the ladder point's result is
    the one trained without extra branches (same fingerprint, same numbers)."""
    cfg = wsd_config(token_budgets=(2048,))  # 16 steps of 128 tokens
    train, val = data
    (plain,) = ladder(cfg)
    (only,) = train_size_wsd([plain], cfg, train, val, [tmp_path / "a" / "p"], tmp_path / "a" / "stable")
    extra = dataclasses.replace(cfg, extra_branches=(0.5,))
    specs = ladder(extra)
    assert [s.point for s in specs] == ["anneal", "ladder"]
    results = train_size_wsd(specs, extra, train, val, [tmp_path / "b" / s.name for s in specs], tmp_path / "b" / "stable")
    assert results[1].val_loss == only.val_loss  # the ladder point: bit for bit on CPU
    assert results[0].steps == 8 and results[0].shared_steps == 6 and math.isfinite(results[0].val_loss)
