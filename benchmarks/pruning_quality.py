"""Block-pruning quality: EntroDrop against cosine_drop at equal removed layers, then recovery by CSD against forward KL.

Run: ``.venv/bin/python benchmarks/pruning_quality.py [--model smollm2] [--model WORKDIR/models/trained/<variant>/<run>]
[--methods entrodrop cosine_drop gradpruner inhernet] [--remove 2 4] [--granularity layer] [--estimator knn] [--losses csd kl] [--steps 6] [--eval-tokens 2048] [--out reports/bench]``

For each model (SmolLM2-135M on the news articles of the prepared validation split, scored and
recovered on news of the training split, as in benchmarks/quant_quality.py; a ladder model on its
workdir's tokens), both methods score every block once on the same calibration windows; for each
``--remove`` count the lowest-scoring blocks are removed and the pruned model's validation
perplexity measured; each pruned model is then distilled from the unpruned one for the same
``--steps`` AdamW steps on the same training windows (embeddings and head frozen unless
``--train-embeddings``) with every loss of ``--losses`` (``csd`` is
the mode-seeking instance, ``csd_cover`` the mode-covering one) and measured again. The teacher's
logits on those windows are computed once and shared by every run. Prints the table and checks the
goals of issue 11: EntroDrop no worse than cosine_drop at equal removed blocks, CSD recovering at
least as much as forward KL. Writes ``<out>/pruning_quality_<model>.csv``.

``--methods`` picks the methods (default the two block-scoring ones). ``gradpruner`` removes the same
number of whole layers by its IGIA-Matrix (``GradPrunerConfig`` defaults, its fine-tuning steps on the
calibration windows) and merges them into their neighbours; ``inhernet`` / ``inhernet_spectrum``
(uniform / spectrum rank allocation) keep every layer and factor the decoder linears down to the
parameter count of the model with ``n`` layers removed, so each ``--remove n`` row compares methods
at (nearly) equal size. Measured on SmolLM2-135M, ``--methods gradpruner inhernet inhernet_spectrum
--remove 2 --losses csd --steps 6`` (dense ppl 40.51): GradPruner removed layers 25 and 26 (merged
into 24), ppl 87.89, 72.28 after CSD; InherNet at 127.2M parameters (ranks 120-360, 92% of the
spectral energy kept) ppl 5.2e7, 2.8e6 after CSD; spectrum allocation 2.7e6, 7478 after CSD. A
factored pair only saves parameters below rank mn/(m+n) (288 for SmolLM2's 576x576), so even a 5%
smaller student truncates about half of every matrix's spectrum, which plain SVD of a trained LLM
does not survive without long distillation. 15.5 min of CPU (19.8 min wall on 2 shared cores).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import sys
import time
from pathlib import Path

import polars as pl
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quant_quality import model_and_text  # noqa: E402

from tasks.compression.block_pruning import (  # noqa: E402
    CosineDropConfig,
    EntroDropConfig,
    angular_scores,
    entropy_scores,
    n_params,
    prune_by_scores,
)
from tasks.compression.distill import DistillConfig, recover, token_windows  # noqa: E402
from tasks.compression.gradpruner import GradPrunerConfig, gradpruner  # noqa: E402
from tasks.compression.inhernet import InherNetConfig, inhernet  # noqa: E402
from tasks.compression.pruning import RECOVERY_LOSSES, CachedTeacher  # noqa: E402
from tasks.lm.loss import evaluate_loss  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LOSSES = RECOVERY_LOSSES
METHODS = ("entrodrop", "cosine_drop", "gradpruner", "inhernet", "inhernet_spectrum")
SCORED = ("entrodrop", "cosine_drop")  # score every block once, then remove the n lowest for each --remove n


def goals(rows: list[dict]) -> list[str]:
    out = []
    pruned = {(r["method"], r["removed_blocks"]): r["ppl"] for r in rows if r["recovery_loss"] == "none"}
    for n in sorted({n for _, n in pruned}):
        e, c = pruned.get(("entrodrop", n)), pruned.get(("cosine_drop", n))
        if e and c:
            out.append(f"{'PASS' if e <= c else 'FAIL'} EntroDrop @ {n} removed: ppl {e:.2f} vs cosine_drop {c:.2f}")
    rec = {(r["method"], r["removed_blocks"], r["recovery_loss"]): r["ppl"] for r in rows}
    for (method, n), before in sorted(pruned.items()):
        csd, kl = rec.get((method, n, "csd")), rec.get((method, n, "kl"))
        if csd and kl:
            out.append(f"{'PASS' if before - csd >= before - kl else 'FAIL'} CSD recovery of {method} @ {n}: "
                       f"ppl {before:.2f} -> {csd:.2f} vs forward KL -> {kl:.2f}")
    return out


def run_model(spec: str, args) -> list[dict]:
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model, val, train, seq_len, name = model_and_text(spec, args.eval_tokens, args.calib_tokens + args.recovery_tokens)
    calib, recovery = train[: args.calib_tokens], train[args.calib_tokens :]

    def ppl(m: nn.Module) -> float:
        return math.exp(evaluate_loss(m, val, seq_len, args.batch_size))

    dense = ppl(model)
    params = n_params(model)
    print(f"[{name}] dense ppl {dense:.2f} on {len(val) - 1} tokens, {params / 1e6:.1f}M params "
          f"({time.perf_counter() - t0:.0f}s)", flush=True)
    rows = [{"model": name, "method": "none", "granularity": args.granularity, "removed_blocks": 0, "removed": "",
             "recovery_loss": "none", "recovery_steps": 0, "recovery_tokens": 0, "ppl": dense, "params": params,
             "removed_fraction": 0.0, "seconds": 0.0}]

    base = dict(n_remove=1, granularity=args.granularity, seq_len=min(seq_len, args.calib_seq_len),
                calib_windows=args.calib_windows)
    configs = {"entrodrop": EntroDropConfig(estimator=args.estimator, **base), "cosine_drop": CosineDropConfig(**base)}
    configs = {m: c for m, c in configs.items() if m in args.methods}
    layer_params = n_params(model.model.layers[0])
    scores = {}
    for method, cfg in configs.items():
        t = time.perf_counter()
        scores[method] = (entropy_scores if method == "entrodrop" else angular_scores)(model, cfg, calib_tokens=calib)
        s = scores[method]
        print(f"[{name}] {method} scores ({time.perf_counter() - t:.0f}s): "
              + " ".join(f"{l}:{v:.3g}" for l, v in enumerate(s.scores))
              + (f"; increasing phase from state {s.phase_start}" if s.phase_start is not None else ""), flush=True)

    teacher = CachedTeacher(model)
    windows = token_windows(recovery, args.recovery_seq_len)

    def prune(method: str, n: int):
        """The ``--remove n`` result of ``method`` and what it removed (layers, or InherNet's ranks)."""
        if method in SCORED:
            pruned = prune_by_scores(model, scores[method], dataclasses.replace(configs[method], n_remove=n))
            return pruned, " ".join(map(str, pruned.removed))
        if method == "gradpruner":
            cfg = GradPrunerConfig(n_remove=n, seq_len=min(seq_len, args.calib_seq_len), calib_windows=args.calib_windows)
            pruned = gradpruner(model, cfg, calib_tokens=calib)
            return pruned, " ".join(f"{l}->{pruned.merged_into.get(l, '-')}" for l in pruned.removed)
        allocation = "spectrum" if method == "inhernet_spectrum" else "uniform"
        inh = inhernet(model, InherNetConfig(target_params=params - n * layer_params, allocation=allocation))
        return inh, (f"none; ranks {min(inh.ranks.values())}-{max(inh.ranks.values())}, "
                     f"energy {inh.meta()['mean_energy']:.3f}")

    for n in args.remove:
        for method in args.methods:
            t = time.perf_counter()
            pruned, removed = prune(method, n)
            p = ppl(pruned.model)
            row = {"model": name, "method": method, "granularity": args.granularity, "removed_blocks": n,
                   "removed": removed, "params": pruned.params_after,
                   "removed_fraction": pruned.params_removed / params}
            rows.append(row | {"recovery_loss": "none", "recovery_steps": 0, "recovery_tokens": 0, "ppl": p,
                               "seconds": round(time.perf_counter() - t, 1)})
            print(f"[{name}] {method} -{n} (removed {removed}): ppl {p:.2f} ({time.perf_counter() - t:.0f}s)", flush=True)
            for loss in args.losses:
                t = time.perf_counter()
                student = copy.deepcopy(pruned.model)
                if not args.train_embeddings:  # tied with the head in SmolLM2: a fifth of the weights, a third of the head's backward
                    student.get_input_embeddings().weight.requires_grad_(False)
                    student.get_output_embeddings().weight.requires_grad_(False)
                kind, weighting = LOSSES[loss]
                dcfg = DistillConfig(loss=kind, weighting=weighting, steps=args.steps, lr=args.lr,
                                     batch_size=args.recovery_batch_size, seq_len=args.recovery_seq_len, seed=0)
                curve = recover(student, teacher, windows, dcfg)
                student.eval()
                rp = ppl(student)
                rows.append(row | {"recovery_loss": loss, "recovery_steps": args.steps, "recovery_tokens": curve.tokens,
                                   "ppl": rp, "seconds": round(time.perf_counter() - t, 1)})
                print(f"[{name}] {method} -{n} + {loss} x{args.steps}: ppl {rp:.2f}; loss "
                      f"{curve.losses[0]:.4g} -> {curve.losses[-1]:.4g} ({time.perf_counter() - t:.0f}s)", flush=True)
                del student

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pl.DataFrame(rows).write_csv(out / f"pruning_quality_{name}.csv")
    cols = ["none", *args.losses]
    print(f"\n| {name}: ppl (dense {dense:.2f}), {args.granularity} blocks | removed | params | pruned | "
          + " | ".join(f"+{c} x{args.steps}" for c in args.losses) + " |\n|---|---|---|---|" + "---|" * len(args.losses))
    for n in args.remove:
        for method in args.methods:
            by = {r["recovery_loss"]: r for r in rows if r["method"] == method and r["removed_blocks"] == n}
            r0 = by["none"]
            print(f"| {method} -{n} | {r0['removed']} | {r0['params'] / 1e6:.1f}M | "
                  + " | ".join(f"{by[c]['ppl']:.2f}" for c in cols) + " |")
    print()
    for line in goals(rows):
        print(line)
    print(f"[{name}] total {time.perf_counter() - t0:.0f}s")
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", help="smollm2 or a trained model folder (repeatable; default smollm2)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(SCORED),
                   help="methods compared (gradpruner removes whole layers; inhernet matches the size of n layers removed)")
    p.add_argument("--remove", type=int, nargs="+", default=[2, 4], help="blocks removed (one run per count)")
    p.add_argument("--granularity", choices=["layer", "attention", "mlp"], default="layer")
    p.add_argument("--estimator", choices=["knn", "histogram"], default="knn", help="EntroDrop's entropy estimator")
    p.add_argument("--losses", nargs="+", choices=sorted(LOSSES), default=["csd", "kl"])
    p.add_argument("--steps", type=int, default=6, help="recovery AdamW steps per run")
    p.add_argument("--train-embeddings", action="store_true", help="also train the embeddings and output head")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--recovery-batch-size", type=int, default=2)
    p.add_argument("--recovery-seq-len", type=int, default=128)
    p.add_argument("--recovery-tokens", type=int, default=4096, help="training tokens the recovery windows come from")
    p.add_argument("--calib-tokens", type=int, default=1024, help="training tokens the blocks are scored on")
    p.add_argument("--calib-windows", type=int, default=4)
    p.add_argument("--calib-seq-len", type=int, default=256)
    p.add_argument("--eval-tokens", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "reports" / "bench"))
    args = p.parse_args()
    if args.granularity != "layer" and set(args.methods) - set(SCORED):
        p.error(f"--granularity {args.granularity}: gradpruner and inhernet work on whole layers (--granularity layer)")
    for spec in args.model or ["smollm2"]:
        run_model(spec, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
