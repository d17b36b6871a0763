"""A run killed with SIGKILL mid-training and started again ends at the uninterrupted run's loss."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from training_fixtures import markov_tokens, tiny_config

from tasks.training.config import RePBConfig
from tasks.training.loop import train_model
from tasks.training.design import ladder
from tasks.training.checkpoint import checkpoint_files, load_checkpoint, save_checkpoint
from tasks.lm.model import build_model

ROOT = Path(__file__).resolve().parents[3]

# The child trains the tiny config for 48 steps with a checkpoint every 10 and prints each step;
# after a checkpoint exists it slows down so the parent's kill lands mid-run.
CHILD = textwrap.dedent("""
    import sys, time
    sys.path[:0] = [{root!r}, {here!r}]
    from training_fixtures import markov_tokens
    from tasks.training.loop import train_model
    from tasks.training.design import ladder
    from test_resume import resume_config
    data = markov_tokens(60_000)
    cfg = resume_config()
    def progress(step, total):
        print("step", step, flush=True)
        if step >= 20:
            time.sleep(0.2)  # a checkpoint exists (step 20): slow down so the kill lands mid-run
    train_model(ladder(cfg)[0], cfg, data[:50_000], data[50_000:], sys.argv[1], progress=progress)
""")


def resume_config(**changes):
    """48 steps, a checkpoint every 10; one thread in every process so float sums agree."""
    return tiny_config(token_budgets=(6144,), checkpoint_interval=10, num_threads=1, **changes)


def test_sigkill_and_resume_matches_uninterrupted(tmp_path):
    data = markov_tokens(60_000)
    train, val = data[:50_000], data[50_000:]
    cfg = resume_config()
    spec = ladder(cfg)[0]
    reference = train_model(spec, cfg, train, val, tmp_path / "reference")

    out = tmp_path / "killed"
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(root=str(ROOT), here=str(Path(__file__).parent)))
    proc = subprocess.Popen([sys.executable, str(script), str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    killed_at = None
    for line in proc.stdout:
        if line.startswith("step") and int(line.split()[1]) >= 24:
            proc.send_signal(signal.SIGKILL)
            killed_at = int(line.split()[1])
            break
    proc.wait(timeout=60)
    assert killed_at is not None and proc.returncode == -signal.SIGKILL, proc.stderr.read()[-3000:]
    assert not (out / "result.json").exists()
    assert [s for s, _, _ in checkpoint_files(out / "checkpoint")] == [20]

    steps_run = []
    resumed = train_model(spec, cfg, train, val, out, progress=lambda s, n: steps_run.append(s))
    assert steps_run[0] == 21 and resumed.steps == reference.steps == 48
    assert resumed.val_loss == reference.val_loss  # bit-identical on CPU
    assert resumed.history == reference.history
    assert not (out / "checkpoint").exists()  # removed once the result is written


def test_interrupted_repb_run_resumes_identically(tmp_path):
    """RePB's window and selection history travel in the checkpoint too."""
    data = markov_tokens(60_000)
    train, val = data[:50_000], data[50_000:]
    cfg = resume_config(repb=RePBConfig(enabled=True, window=3, keep_ratio=0.5))
    spec = ladder(cfg)[0]
    reference = train_model(spec, cfg, train, val, tmp_path / "reference")

    def interrupt(step, total):
        if step == 25:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_model(spec, cfg, train, val, tmp_path / "run", progress=interrupt)
    resumed = train_model(spec, cfg, train, val, tmp_path / "run")
    assert resumed.val_loss == reference.val_loss
    assert resumed.history == reference.history
    assert resumed.repb_kept_frac == reference.repb_kept_frac


def test_checkpoint_roundtrip_and_incomplete_checkpoint_ignored(tmp_path):
    cfg = tiny_config()
    spec = ladder(cfg)[0]
    model = build_model(spec.shape, 256, 32, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (2, 32))
    model(input_ids=x, use_cache=False).logits.sum().backward()
    opt.step()
    save_checkpoint(tmp_path, 5, model, opt, {"note": "five"})
    # a later checkpoint whose JSON never got written (killed between the two files)
    (tmp_path / "state-00000009.safetensors").write_bytes(b"partial")
    other = build_model(spec.shape, 256, 32, seed=1)
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-3)
    meta, extra = load_checkpoint(tmp_path, other, other_opt)
    assert meta["step"] == 5 and meta["note"] == "five" and extra == {}
    for (k, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), k
    sa, sb = opt.state_dict()["state"], other_opt.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sa[i][key], sb[i][key])


def test_checkpoint_of_other_config_refused(tmp_path):
    data = markov_tokens(60_000)
    cfg = tiny_config(token_budgets=(2048,), checkpoint_interval=4)
    spec = ladder(cfg)[0]
    calls = []

    def stop(step, total):
        calls.append(step)
        if step == 6:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_model(spec, cfg, data[:50_000], data[50_000:], tmp_path, progress=stop)
    assert (tmp_path / "checkpoint" / "state-00000004.json").exists()
    import dataclasses

    with pytest.raises(ValueError, match="different config"):
        train_model(spec, dataclasses.replace(cfg, lr=1e-2), data[:50_000], data[50_000:], tmp_path)
    resumed_steps = []
    train_model(spec, cfg, data[:50_000], data[50_000:], tmp_path, progress=lambda s, n: resumed_steps.append(s))
    assert resumed_steps[0] == 5  # resumed after the step-4 checkpoint
