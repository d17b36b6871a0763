"""The GPU checks of ``benchmarks/gpu_check.sh`` that have no script of their own: training speed,
the downstream scorer on CUDA against the CPU, and DDP on one GPU against the plain loop.

Run: ``python benchmarks/gpu_check.py {train,scorer,ddp1} [--dry-run] [--out DIR]``

* ``train``: the ``full`` preset's largest rung (params/training.yaml) for ``--steps`` steps with
  bf16 autocast and ``torch.compile`` (the loop's own CUDA settings), at the preset's micro-batch
  and sequence length; prints tokens/s and MFU (model FLOPs per token x tokens/s over the GPU's
  peak bf16 FLOP/s, :func:`tasks.lm.model.peak_flops`) against the issue's goal (>= 35%).
* ``scorer``: :func:`tasks.evaluation.downstream.score_encoded`'s packed token-tree path on the
  same items, fp32 on the CPU and bf16 autocast on CUDA, with one randomly initialised model of
  that rung (the check is the path's agreement, not the model's accuracy): the largest per-choice
  log-likelihood difference and how many items keep their argmax.
* ``ddp1``: the same small point trained by the plain loop and by one DDP worker (the
  distributed path at W = 1: process group, DDP wrapper, rank-0 checkpoints): losses and tokens/s.

``--dry-run`` runs each on the CPU at a tiny size, so the script itself is checked where no GPU
is. Every check writes ``<out>/gpu_check_<name>.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tasks.common.params import load_stage_config  # noqa: E402
from tasks.evaluation.downstream import EncodedItem, ScoringConfig, TaskItem, score_encoded  # noqa: E402
from tasks.training.config import TrainingConfig  # noqa: E402
from tasks.lm.model import ModelShape  # noqa: E402
from tasks.training.distributed import PointJob, _launch_local, train_points  # noqa: E402
from tasks.training.design import ladder  # noqa: E402
from tasks.lm.model import build_model, peak_flops  # noqa: E402
from tasks.training.tokenizer import save_tokens  # noqa: E402

MFU_GOAL = 0.35


def full_point(steps: int, dry_run: bool, *, compile_model: bool) -> TrainingConfig:
    """The full preset's largest rung for ``steps`` steps (dry run: a tiny shape and batch)."""
    base = load_stage_config(TrainingConfig, ROOT, "training", "full")
    largest = max(base.sizes, key=lambda s: (s.d_model, s.n_layers))
    changes: dict = {}
    if dry_run:
        largest = ModelShape(d_model=32, n_layers=2, n_heads=2)
        changes = dict(vocab_size=512, seq_len=64, batch_size=4)
    seq_len, batch = changes.get("seq_len", base.seq_len), changes.get("batch_size", base.batch_size)
    return dataclasses.replace(
        base, sizes=(largest,), compute_budgets=(), token_budgets=(steps * batch * seq_len,), grad_accum=1,
        schedule="cosine", warmup_steps=None, eval_interval=10 * steps, eval_tokens=2 * seq_len + 1,
        log_interval=max(1, steps // 5), checkpoint_interval=0, seeds=(), seed_sizes=(), extra_branches=(),
        arch_compare=(), compile=compile_model, num_threads=0, **changes)


def token_files(root: Path, cfg: TrainingConfig, n_train: int) -> tuple[str, str]:
    rng = np.random.default_rng(0)
    dtype = np.uint16 if cfg.vocab_size <= 65535 else np.uint32
    return (str(save_tokens(root / "train.npy", rng.integers(0, cfg.vocab_size, n_train, dtype=dtype))),
            str(save_tokens(root / "val.npy", rng.integers(0, cfg.vocab_size, 4 * cfg.seq_len, dtype=dtype))))


def check_train(args) -> dict:
    cfg = full_point(args.steps, args.dry_run, compile_model=not args.dry_run)
    spec = ladder(cfg)[0]
    with tempfile.TemporaryDirectory() as tmp:
        files = token_files(Path(tmp), cfg, spec.tokens + 2 * cfg.seq_len * cfg.batch_size)
        job = PointJob(specs=[spec], cfg=cfg, train_path=files[0], val_path=files[1], out_dirs=[str(Path(tmp) / "run")])
        t0 = time.perf_counter()
        result = train_points(job, device=args.device)[0]
        wall = time.perf_counter() - t0
    out = {"check": "train", "device": device_name(args.device), "size": spec.size, "n_params_total": spec.n_params_total,
           "seq_len": cfg.seq_len, "micro_batch": cfg.batch_size, "steps": spec.steps, "compile": cfg.compile,
           "tokens_per_s": result.tokens_per_s, "mfu": result.mfu, "mfu_goal": MFU_GOAL,
           "flops_per_token": spec.flops_per_token, "wall_s": wall, "final_train_loss": result.history[-1][1]}
    mfu = f"{result.mfu:.1%} (goal >= {MFU_GOAL:.0%})" if result.mfu is not None else "n/a (no known peak)"
    print(f"train {spec.size} ({spec.n_params_total:,} params), {spec.steps} steps of {cfg.batch_size}x{cfg.seq_len}, "
          f"compile={cfg.compile}: {result.tokens_per_s:,.0f} tokens/s, MFU {mfu}, wall {wall:.1f} s")
    return out


def synthetic_items(n: int, vocab: int, rng: np.random.Generator) -> list[EncodedItem]:
    """Items of 4 choices: a shared context of 20-60 tokens, continuations of 1-12 tokens."""
    items = []
    for i in range(n):
        ctx = tuple(int(t) for t in rng.integers(1, vocab, int(rng.integers(20, 60))))
        conts = tuple(tuple(int(t) for t in rng.integers(1, vocab, int(rng.integers(1, 12)))) for _ in range(4))
        item = TaskItem(task="synthetic", doc_id=i, gold=0, contexts=("",) * 4, continuations=("x",) * 4)
        items.append(EncodedItem(item=item, ctxs=(ctx,) * 4, conts=conts, cont_chars=(1,) * 4, cont_bytes=(1,) * 4))
    return items


def check_scorer(args) -> dict:
    cfg = full_point(1, args.dry_run, compile_model=False)
    shape = cfg.sizes[0]
    rng = np.random.default_rng(0)
    items = synthetic_items(16 if args.dry_run else 200, cfg.vocab_size, rng)
    scoring = ScoringConfig(batch_tokens=4096, row_tokens=256, progress=0)
    model = build_model(shape, cfg.vocab_size, cfg.seq_len, cfg.arch, seed=0)
    t0 = time.perf_counter()
    cpu = score_encoded(model, items, scoring, pad_token_id=0)
    cpu_s = time.perf_counter() - t0
    model.to(args.device)
    score_encoded(model, items[:4], scoring, pad_token_id=0)  # warm-up (kernels, allocator)
    t0 = time.perf_counter()
    dev = score_encoded(model, items, scoring, pad_token_id=0)
    dev_s = time.perf_counter() - t0
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(cpu, dev))
    rel = max(float(np.max(np.abs(a - b) / np.maximum(np.abs(a), 1e-6))) for a, b in zip(cpu, dev))
    same = sum(int(np.argmax(a) == np.argmax(b)) for a, b in zip(cpu, dev))
    out = {"check": "scorer", "device": device_name(args.device), "size": shape.tag, "items": len(items),
           "max_abs_loglik_diff": diff, "max_rel_loglik_diff": rel, "argmax_agree": same,
           "cpu_s": cpu_s, "device_s": dev_s}
    print(f"scorer packed path, {len(items)} items of 4 choices, {shape.tag}: {device_name(args.device)} vs CPU fp32: "
          f"max |d loglik| {diff:.4f} nats (relative {rel:.2e}), argmax agrees on {same}/{len(items)}; "
          f"CPU {cpu_s:.2f} s, device {dev_s:.2f} s")
    return out


def check_ddp1(args) -> dict:
    cfg = full_point(args.steps, args.dry_run, compile_model=False)
    if not args.dry_run:  # one micro-batch of the largest rung fits; keep the run short
        cfg = dataclasses.replace(cfg, gpus_per_worker=1)
    spec = ladder(cfg)[0]
    with tempfile.TemporaryDirectory() as tmp:
        files = token_files(Path(tmp), cfg, spec.tokens + 2 * cfg.seq_len * cfg.batch_size)

        def job(name):
            return PointJob(specs=[spec], cfg=cfg, train_path=files[0], val_path=files[1],
                            out_dirs=[str(Path(tmp) / name)])

        plain = train_points(dataclasses.replace(job("plain"), cfg=dataclasses.replace(cfg, gpus_per_worker=0)),
                             device=args.device)[0]
        ddp = _launch_local(job("ddp"), None, None)[0]  # the W > 1 path, at W = 1
    out = {"check": "ddp1", "device": device_name(args.device), "size": spec.size, "steps": spec.steps,
           "plain_tokens_per_s": plain.tokens_per_s, "ddp_tokens_per_s": ddp.tokens_per_s,
           "ratio": ddp.tokens_per_s / plain.tokens_per_s, "plain_val_loss": plain.val_loss,
           "ddp_val_loss": ddp.val_loss, "val_loss_diff": abs(plain.val_loss - ddp.val_loss)}
    print(f"ddp on 1 worker vs plain loop, {spec.size}, {spec.steps} steps: {ddp.tokens_per_s:,.0f} vs "
          f"{plain.tokens_per_s:,.0f} tokens/s ({out['ratio']:.2f}x); val_loss {ddp.val_loss:.5f} vs "
          f"{plain.val_loss:.5f}")
    return out


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device.startswith("cuda") else f"cpu ({torch.get_num_threads()} threads)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("check", choices=("train", "scorer", "ddp1"))
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: check the script, not the GPU")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default: 60 on GPU, 6 dry)")
    ap.add_argument("--out", type=Path, default=Path("reports/bench"))
    args = ap.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit(f"gpu_check {args.check}: no CUDA device (torch {torch.__version__}); use --dry-run on a CPU")
    args.device = "cpu" if args.dry_run else "cuda"
    args.steps = args.steps or (6 if args.dry_run else 60)
    if peak_flops(args.device) is None and not args.dry_run:
        print(f"note: {device_name(args.device)} is not in the peak-FLOPs table; MFU is not reported")
    result = {"train": check_train, "scorer": check_scorer, "ddp1": check_ddp1}[args.check](args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"gpu_check_{args.check}.json").write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
