"""Train the ladder: AdamW, WSD cooldown branches or per-run cosine, resumable checkpoints, validation loss.

A run is fully determined by (config, spec, token arrays): the weights by ``build_model``'s seed,
the data order by ``(seed, step)`` (see :class:`WindowSampler`), the learning rate by the step
(:func:`tasks.training.design.lr_at`); nothing else draws random numbers (dropout is 0). A
checkpoint holds the weights, AdamW's tensors and every piece of loop state, so a run killed at
any point and started again reaches the same final loss, bit for bit on CPU.

Under ``schedule: wsd`` (:func:`train_size_wsd`) a size trains one stable run to the last
branch point, keeping a checkpoint at each branch point (``stable/branches/<step>/``); each budget
is then a cooldown branch that starts from that checkpoint. The first ``decay_start`` steps of a
branch are the stable run's steps (same lr, same batches), so a branch is the run that would have
been trained alone, at a fraction of the compute; the stable run and every branch resume after a
kill from their own checkpoints.

Outputs in ``out_dir``::

    config.json          resolved TrainingConfig + HF model config + spec + arch (written first)
    checkpoint/          state-<step>.safetensors + state-<step>.json while the run is in progress
    model.safetensors    final weights
    doc_losses.parquet   the final model's loss per validation document (doc, tokens, loss_sum),
                         when the caller gave each validation token's document; written before
                         result.json, so a complete run always has it
    result.json          TrainResult; its presence marks the run complete (a sweep skips it)

The point's ``val_loss`` is the final model's mean loss over the *whole* validation split, scored
once at the end (:func:`tasks.lm.loss.token_losses` with no token limit); that one pass
also gives the per-source and per-document losses. The curve in ``history`` (and every
``val_loss`` passed to ``on_metrics``) stays on the first ``eval_tokens``, which is cheap to
score every ``eval_interval`` steps.

A run whose training or validation loss turns NaN/inf stops there and is recorded with
``diverged: true`` and no loss (it is excluded from the fits, and the rest of the ladder goes on).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
import polars as pl
from torch import nn

from tasks.common.config import to_dict
from tasks.common.io import atomic_path, read_json, write_json
from tasks.lm.loss import evaluate_loss, loss_by_document, loss_by_group, perplexity, target_indices, token_losses
from tasks.lm.model import build_model, peak_flops
from tasks.training.checkpoint import checkpoint_files, load_checkpoint, save_checkpoint
from tasks.training.config import TrainingConfig
from tasks.training.design import RunSpec, lr_at, stable_steps
from tasks.training.repb import RePBSelector, weighted_step_loss
from tasks.zoo.ladder import CONFIG_FILE, RESULT_FILE, load_model, write_weights

MetricsCallback = Callable[[dict[str, float], int], None]
ProgressCallback = Callable[[int, int], None]


class WorkerGroup(Protocol):
    """One of W worker processes training a run together: the hooks the loop calls.

    Implemented by :class:`tasks.training.distributed.DataParallel` (DDP or FSDP2), which builds on
    this module; None everywhere below means the plain one-process loop.
    """

    is_main: bool
    world: int
    device: torch.device

    def wrap(self, model: nn.Module, *, compile: bool) -> nn.Module: ...
    def micro_batches(self, accum: int) -> range: ...
    def grad_sync(self, *, last: bool) -> contextlib.AbstractContextManager[None]: ...
    def sum_loss(self, loss_sum: torch.Tensor, count: int) -> int: ...
    def save_checkpoint(self, ckpt_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                        meta: dict[str, Any], extra_tensors: dict[str, torch.Tensor] | None = None) -> None: ...
    def load_checkpoint(self, ckpt_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer
                        ) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None: ...
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]: ...
    def barrier(self) -> None: ...


# --------------------------------------------------------------------------------------------
# Data order


class WindowSampler:
    """Training sequences: non-overlapping windows of the stream, a fresh permutation per epoch.

    Sample ``g`` (a global counter: step ``s``, micro-batch ``m``, row ``r`` is
    ``g = (s * grad_accum + m) * batch_size + r``) lies in epoch ``e = g // n_windows``; the epoch's
    order and a start shift in ``[0, seq_len)`` come from ``np.random.default_rng([seed, e])``,
    so any batch is reproducible from ``(seed, step)`` alone — no generator state to checkpoint.
    Within an epoch no window repeats (single-epoch training while D <= the corpus, as Chinchilla).
    """

    def __init__(self, n_tokens: int, seq_len: int, seed: int) -> None:
        self.seq_len = seq_len
        self.seed = seed
        # Room for the largest shift: shift + n*T + 1 <= n_tokens for every shift < T.
        self.n_windows = (n_tokens - seq_len) // seq_len
        if self.n_windows < 1:
            raise ValueError(f"train_tokens: need at least {2 * seq_len} tokens for seq_len {seq_len}, got {n_tokens}")
        self._epoch: int | None = None
        self._perm: np.ndarray | None = None
        self._shift = 0

    def _set_epoch(self, epoch: int) -> None:
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._shift = int(rng.integers(self.seq_len))
            self._perm = rng.permutation(self.n_windows)
            self._epoch = epoch

    def windows(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Sample ids (window index, stable across epochs) and token offsets of samples ``start..start+count``."""
        ids = np.empty(count, dtype=np.int64)
        offsets = np.empty(count, dtype=np.int64)
        for j, g in enumerate(range(start, start + count)):
            epoch, pos = divmod(g, self.n_windows)
            self._set_epoch(epoch)
            ids[j] = self._perm[pos]
            offsets[j] = self._shift + ids[j] * self.seq_len
        return ids, offsets

    def batch(self, tokens: np.ndarray, start: int, count: int) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        """``(sample_ids, x, y)``: x, y int64 of shape (count, seq_len), y shifted by one."""
        ids, offsets = self.windows(start, count)
        rows = np.asarray(tokens[offsets[:, None] + np.arange(self.seq_len + 1)]).astype(np.int64)
        data = torch.from_numpy(rows)
        return ids, data[:, :-1], data[:, 1:]


# --------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    """One trained point. ``tokens`` is D actually trained; ``val_loss`` the final model's mean
    validation loss over the whole validation split (nats; None when the run diverged), over
    ``val_tokens`` scored targets (whole windows of ``seq_len``); ``history``'s validation losses
    are on the first ``eval_tokens`` only, so its last entry differs from ``val_loss``.

    Accounting (one convention, :func:`tasks.lm.model.model_flops_per_token`):
    ``n_params`` non-embedding N, ``n_params_total`` every weight, ``flops_total`` =
    ``flops_per_token * tokens`` (the run's training FLOPs, whether or not a WSD branch shared its
    first ``shared_steps`` steps with its stable run), ``epochs`` = tokens / the variant's
    training tokens (windows the sampler can draw), ``unique_tokens`` = min of the two.
    ``tokens_per_s`` and ``mfu`` leave out the first timed segment (compilation, warm-up) when
    there is a later one.
    """

    name: str
    n_params: int
    n_params_total: int
    tokens: int
    steps: int
    val_loss: float | None
    ppl: float | None
    tokens_per_s: float
    flops_per_token: float
    flops_total: float
    wall_s: float
    mfu: float | None
    epochs: float
    unique_tokens: int
    train_tokens_available: int
    lr: float
    schedule: str
    shared_steps: int = 0
    compute_budget: float | None = None
    val_tokens: int | None = None
    diverged: bool = False
    diverged_reason: str | None = None
    val_loss_by_group: dict[str, dict[str, float]] | None = None
    history: list[tuple[int, float | None, float | None]] = field(default_factory=list)
    repb_kept_frac: float | None = None
    devices: int = 1  # worker processes (one device each) the run trained on; mfu is per device

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["history"] = [list(h) for h in self.history]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainResult:
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["history"] = [tuple(h) for h in kw.get("history", [])]
        return cls(**kw)


# The extra seeds are other runs (each trains with ``seed`` replaced), not a change to this one.
_NOT_IN_FINGERPRINT = ("sizes", "token_budgets", "compute_budgets", "sizes_per_budget", "tokens_per_param_guess",
                       "variants", "checkpoint_interval", "compile", "num_threads", "seeds", "seed_sizes",
                       # which points and arms the ladder trains, not what one run is
                       "extra_branches", "arch_compare", "feasibility",
                       # how many processes share a step, not what the step computes
                       "workers_per_point", "gpus_per_worker", "parallel")


def run_fingerprint(spec: RunSpec, cfg: TrainingConfig) -> str:
    """Hash of everything that changes a run's numbers (not the ladder lists or checkpoint cadence)."""
    c = to_dict(cfg)
    # Performance knobs are left out: they change float summation order, not what the run is.
    for k in _NOT_IN_FINGERPRINT:
        c.pop(k, None)
    blob = json.dumps({"cfg": c, "spec": spec.key()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def stable_fingerprint(spec: RunSpec, cfg: TrainingConfig) -> str:
    """Hash of what a WSD stable run's steps depend on: every budget of a size shares it.

    The stable phase's lr is the warmup and then the constant peak (:func:`lr_at`), so the budget,
    the step count and the cooldown start are left out.
    """
    shared = {k: v for k, v in spec.key().items()
              if k not in ("name", "tokens", "steps", "decay_start", "compute_budget")}
    c = to_dict(cfg)
    for k in _NOT_IN_FINGERPRINT:
        c.pop(k, None)
    blob = json.dumps({"cfg": c, "stable": shared}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# Checkpoints


def _optimizer(model: nn.Module, cfg: TrainingConfig, device: torch.device) -> torch.optim.AdamW:
    # Weight decay on matrices (incl. embeddings), not on norm gains or biases (GPT-2/LLaMA practice).
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kwargs: dict[str, Any] = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=1e-8, **kwargs)


# --------------------------------------------------------------------------------------------
# Training

def _resolve_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _config_record(spec: RunSpec, cfg: TrainingConfig, model: nn.Module, fingerprint: str) -> dict[str, Any]:
    return {
        "arch": cfg.arch,
        "vocab_size": cfg.vocab_size,
        "seq_len": cfg.seq_len,
        "spec": spec.to_dict(),
        "training": to_dict(cfg),
        "model_config": model.config.to_dict(),
        "fingerprint": fingerprint,
    }


def _finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


class _Trainer:
    """Model, optimizer, sampler and loop state of one run; :meth:`run` advances it by steps.

    ``spec`` sets the lr schedule (:func:`lr_at`); a WSD stable run uses its size's longest
    budget, whose steps before any branch point have the lr every branch has there.
    ``parallel`` (one of W worker processes, :class:`tasks.training.distributed.DataParallel`):
    the model is wrapped in DDP or sharded by FSDP2, this rank trains its contiguous share of each
    step's micro-batches, and checkpoints go through it; None is the plain one-process loop.
    """

    def __init__(self, spec: RunSpec, cfg: TrainingConfig, train_tokens: np.ndarray, val_tokens: np.ndarray,
                 device: torch.device | str | None, val_groups: np.ndarray | None = None,
                 val_docs: np.ndarray | None = None, parallel: WorkerGroup | None = None) -> None:
        for label, arr in (("train_tokens", train_tokens), ("val_tokens", val_tokens)):
            if len(arr) and int(np.max(arr)) >= cfg.vocab_size:
                raise ValueError(f"{label}: token id {int(np.max(arr))} >= vocab_size {cfg.vocab_size}")
        self.spec, self.cfg = spec, cfg
        self.train_tokens, self.val_tokens, self.val_groups = train_tokens, val_tokens, val_groups
        self.val_docs = val_docs
        self.doc_losses: pl.DataFrame | None = None  # set by result() when val_docs is given
        self.parallel = parallel
        self.device = parallel.device if parallel is not None else _resolve_device(device)
        self.sampler = WindowSampler(len(train_tokens), cfg.seq_len, cfg.seed)
        self.model = build_model(spec.shape, cfg.vocab_size, cfg.seq_len, cfg.arch, cfg.seed).to(self.device)
        self.model.train()
        if parallel is not None:  # before the optimizer: FSDP2 replaces the parameters by shards
            self.forward_model = parallel.wrap(self.model, compile=cfg.compile)
        else:
            self.forward_model = torch.compile(self.model) if cfg.compile else self.model
        self.optimizer = _optimizer(self.model, cfg, self.device)
        self.selector = RePBSelector(cfg.repb, n_samples=self.sampler.n_windows) if cfg.repb.enabled else None
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.step = 0
        self.history: list[tuple[int, float | None, float | None]] = []
        self.train_time = 0.0  # seconds in training steps (not eval, not checkpoint), over all attempts
        self.timed_time = 0.0  # the same, leaving out each attempt's first segment (compile, warm-up)
        self.timed_steps = 0
        self.prior_wall = 0.0  # wall seconds of earlier attempts (and of the stable run a branch left)
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.loss_count = 0
        self.val_loss: float | None = None
        self.diverged: str | None = None
        self.t_start = time.perf_counter()

    # -- state ------------------------------------------------------------------------------

    def meta(self, fingerprint: str) -> dict[str, Any]:
        return {
            "fingerprint": fingerprint, "steps": self.spec.steps, "history": [list(h) for h in self.history],
            "train_time_s": self.train_time, "timed_time_s": self.timed_time, "timed_steps": self.timed_steps,
            "wall_s": self.prior_wall + time.perf_counter() - self.t_start,
            "loss_sum": float(self.loss_sum), "loss_count": self.loss_count, "val_loss": self.val_loss,
            "repb": self.selector.state_scalars() if self.selector is not None else None,
        }

    def save(self, ckpt_dir: Path, fingerprint: str) -> None:
        save = self.parallel.save_checkpoint if self.parallel is not None else save_checkpoint
        save(ckpt_dir, self.step, self.model, self.optimizer, self.meta(fingerprint),
             self.selector.state_tensors() if self.selector is not None else None)

    def restore(self, ckpt_dir: Path, fingerprint: str, what: str) -> bool:
        """Load the newest checkpoint of ``ckpt_dir`` if there is one; it must carry ``fingerprint``."""
        load = self.parallel.load_checkpoint if self.parallel is not None else load_checkpoint
        loaded = load(ckpt_dir, self.model, self.optimizer)
        if loaded is None:
            return False
        meta, others = loaded
        if meta.get("fingerprint") != fingerprint:
            raise ValueError(f"{ckpt_dir}: {what} checkpoint of a different config or spec "
                             f"({meta.get('fingerprint')} != {fingerprint}); delete it to retrain")
        self.step = int(meta["step"])
        self.history = [tuple(h) for h in meta["history"]]
        self.train_time = float(meta["train_time_s"])
        self.timed_time = float(meta.get("timed_time_s", 0.0))
        self.timed_steps = int(meta.get("timed_steps", 0))
        self.prior_wall = float(meta["wall_s"])
        self.loss_sum.fill_(float(meta["loss_sum"]))
        self.loss_count = int(meta["loss_count"])
        self.val_loss = meta["val_loss"]
        if self.selector is not None:
            self.selector.load_state(others, meta["repb"])
        return True

    # -- one optimizer step -----------------------------------------------------------------

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda"
                    else torch.autocast("cpu", enabled=False))
        with autocast:
            return self.forward_model(input_ids=x, use_cache=False).logits

    def _per_sample_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self._logits(x)
        per_token = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1),
                                    reduction="none").view(y.shape)
        return per_token.mean(dim=1)

    def _train_step(self, step: int) -> None:
        b, accum = self.cfg.batch_size, self.cfg.grad_accum
        # this worker's contiguous share of the step's micro-batches (all of them on one process)
        micros = self.parallel.micro_batches(accum) if self.parallel is not None else range(accum)
        batches = []
        for micro in micros:
            ids, x, y = self.sampler.batch(self.train_tokens, (step * accum + micro) * b, b)
            batches.append((ids, x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)))
        if self.selector is None:
            for i, (_, x, y) in enumerate(batches):
                # W workers: gradients are averaged over workers once, at the last micro-batch
                with (self.parallel.grad_sync(last=i == len(batches) - 1) if self.parallel is not None
                      else contextlib.nullcontext()):
                    logits = self._logits(x)
                    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
                    self.loss_sum += loss.detach()
                    self.loss_count += 1
                    (loss / len(batches)).backward()
            return
        # RePB selects over the whole optimizer step. With one micro-batch the training forward's
        # own losses are the scores; with several, a no-grad scoring forward over the step's
        # micro-batches comes first (about +1/3 compute), so selection sees every sample of the step.
        ids_all = np.concatenate([ids for ids, _, _ in batches])
        if accum == 1:
            per_sample = self._per_sample_loss(batches[0][1], batches[0][2])
            graphs = [per_sample]
            scores = per_sample.detach()
        else:
            graphs = None
            with torch.no_grad():
                scores = torch.cat([self._per_sample_loss(x, y) for _, x, y in batches])
        keep, weight = self.selector.select(scores.float().cpu().numpy(), ids_all)
        n_kept = int(keep.sum())
        w_all = torch.from_numpy(weight).to(self.device, torch.float32)
        for m, (_, x, y) in enumerate(batches):
            per_sample = graphs[0] if graphs is not None else self._per_sample_loss(x, y)
            self.loss_sum += per_sample.detach().mean()  # the unpruned batch loss, comparable across runs
            self.loss_count += 1
            weighted_step_loss(per_sample, w_all[m * b:(m + 1) * b], n_kept).backward()

    # -- the loop ---------------------------------------------------------------------------

    def run(self, end: int, *, fingerprint: str, ckpt_dir: Path, on_metrics: MetricsCallback | None,
            progress: ProgressCallback | None, keep_steps: tuple[int, ...] = (), keep_dir: Path | None = None) -> None:
        """Train steps ``[self.step, end)``; validate every ``eval_interval`` steps and at ``spec.steps``.

        Rolling checkpoints every ``checkpoint_interval`` steps in ``ckpt_dir``; at each of
        ``keep_steps`` a permanent one in ``keep_dir/<step>/`` (a WSD branch point). Stops early,
        with ``self.diverged`` set, when a training or validation loss is not finite.
        """
        cfg, total = self.cfg, self.spec.steps
        t_segment = time.perf_counter()
        first_segment = True
        segment_start = self.step
        for step in range(self.step, end):
            lr = lr_at(step, self.spec, cfg)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self._train_step(step)
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip, foreach=True)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            done = self.step = step + 1

            is_eval = done % cfg.eval_interval == 0 or done == total
            is_log = done % cfg.log_interval == 0 or is_eval or done == end
            is_keep = done in keep_steps
            is_ckpt = ((cfg.checkpoint_interval > 0 and done % cfg.checkpoint_interval == 0) or is_keep) and done < total
            if is_log or is_ckpt:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                now = time.perf_counter()
                self.train_time += now - t_segment
                if not first_segment:
                    self.timed_time += now - t_segment
                    self.timed_steps += done - segment_start
                first_segment = False
                segment_start = done
            if is_log:
                if self.parallel is not None:  # every worker's micro-batches, as one process would count them
                    self.loss_count = self.parallel.sum_loss(self.loss_sum, self.loss_count)
                train_loss = float(self.loss_sum) / max(self.loss_count, 1)
                self.loss_sum.zero_()
                self.loss_count = 0
                metrics = {"train_loss": train_loss, "lr": lr, "tokens_per_s": self.tokens_per_s()}
                point_val = None
                if not math.isfinite(train_loss):
                    self.diverged = f"training loss {train_loss} at step {done}"
                elif is_eval:
                    point_val = self.evaluate()
                    metrics["val_loss"] = point_val
                    if not math.isfinite(point_val):
                        self.diverged = f"validation loss {point_val} at step {done}"
                self.history.append((done, _finite_or_none(train_loss), _finite_or_none(point_val)))
                if on_metrics is not None:
                    on_metrics({k: v for k, v in metrics.items() if math.isfinite(v)}, done)
                if self.diverged:
                    return
            if is_ckpt:
                self.save(ckpt_dir, fingerprint)
                if is_keep and keep_dir is not None:
                    self.save(keep_dir / f"{done:08d}", fingerprint)
            if is_log or is_ckpt:
                t_segment = time.perf_counter()
            if progress is not None:
                progress(done, total)

    def evaluate(self) -> float:
        self.val_loss = evaluate_loss(self.model, self.val_tokens, self.cfg.seq_len, self.cfg.batch_size,
                                      self.cfg.eval_tokens, self.device)
        self.model.train()
        return self.val_loss

    def tokens_per_s(self) -> float:
        if self.timed_time > 0:
            return self.timed_steps * self.spec.tokens_per_step / self.timed_time
        return self.step * self.spec.tokens_per_step / max(self.train_time, 1e-9)

    def result(self) -> TrainResult:
        spec, cfg = self.spec, self.cfg
        d = spec.tokens_trained
        available = self.sampler.n_windows * cfg.seq_len
        devices = self.parallel.world if self.parallel is not None else 1
        peak = peak_flops(self.device)
        peak = peak * devices if peak else None  # tps counts every worker's tokens
        tps = self.tokens_per_s()
        val, n_val, by_group = None, None, None
        if not self.diverged:
            full = score_validation(self.model, self.val_tokens, cfg.seq_len, cfg.batch_size, self.device,
                                    val_groups=self.val_groups, val_docs=self.val_docs)
            if math.isfinite(full.val_loss):
                val, n_val, by_group, self.doc_losses = full.val_loss, full.val_tokens, full.by_group, full.doc_losses
            else:
                self.diverged = f"full-split validation loss {full.val_loss} at step {self.step}"
        return TrainResult(
            name=spec.name, n_params=spec.n_params, n_params_total=spec.n_params_total, tokens=d, steps=spec.steps,
            val_loss=val, ppl=perplexity(val) if val is not None else None, tokens_per_s=tps,
            flops_per_token=spec.flops_per_token, flops_total=spec.flops_per_token * d,
            wall_s=self.prior_wall + time.perf_counter() - self.t_start,
            mfu=(spec.flops_per_token * tps / peak) if peak else None,
            epochs=d / available, unique_tokens=min(d, available), train_tokens_available=available,
            lr=spec.lr, schedule=cfg.schedule, shared_steps=spec.decay_start if cfg.schedule == "wsd" else 0,
            compute_budget=spec.compute_budget, val_tokens=n_val,
            diverged=self.diverged is not None, diverged_reason=self.diverged,
            val_loss_by_group=by_group, history=self.history,
            repb_kept_frac=self.selector.kept_fraction if self.selector is not None else None,
            devices=devices,
        )


DOC_LOSSES_FILE = "doc_losses.parquet"


@dataclass(frozen=True, kw_only=True)
class ValidationScore:
    """A model scored once over the whole validation split (:func:`score_validation`)."""

    val_loss: float  # mean nats over every scored target
    val_tokens: int  # scored targets: whole windows of seq_len
    by_group: dict[str, dict[str, float]] | None  # {label: {"tokens": n, "val_loss": mean}}
    doc_losses: pl.DataFrame | None  # doc (int64), tokens (int64), loss_sum (float64 nats)


def score_validation(model: nn.Module, val_tokens: np.ndarray, seq_len: int, batch_size: int,
                     device: torch.device | str | None, *, val_groups: np.ndarray | None = None,
                     val_docs: np.ndarray | None = None) -> ValidationScore:
    """One forward pass over every validation token: the full-split mean loss, and from the same
    per-token losses the loss per group label and per document.

    ``val_groups`` / ``val_docs``: shape of ``val_tokens``, a label (source) / document index per
    token; each scored loss is attributed to the token it predicts (:func:`target_indices`).
    Per document (:func:`tasks.lm.loss.loss_by_document`) the table keeps sums, so
    ``doc_losses["loss_sum"].sum() / doc_losses["tokens"].sum() == val_loss`` up to rounding.
    """
    losses = token_losses(model, val_tokens, seq_len, batch_size, None, device)
    targets = target_indices(len(losses))
    by_group = doc_losses = None
    if val_groups is not None:
        groups = np.asarray(val_groups)[targets]
        by_group = {str(k): {"tokens": int(n), "val_loss": float(v)}
                    for k, (n, v) in loss_by_group(losses, groups).items()}
    if val_docs is not None:
        doc, tokens, loss_sum = loss_by_document(losses, np.asarray(val_docs)[targets])
        doc_losses = pl.DataFrame({"doc": doc, "tokens": tokens, "loss_sum": loss_sum},
                                  schema={"doc": pl.Int64, "tokens": pl.Int64, "loss_sum": pl.Float64})
    return ValidationScore(val_loss=float(losses.sum() / losses.size), val_tokens=int(losses.size),
                           by_group=by_group, doc_losses=doc_losses)


def write_doc_losses(path: str | Path, frame: pl.DataFrame) -> Path:
    """Write a run's per-document losses (``doc, tokens, loss_sum``) atomically as Parquet."""
    path = Path(path)
    with atomic_path(path) as tmp:
        frame.write_parquet(tmp)
    return path


def read_doc_losses(out_dir: str | Path) -> pl.DataFrame:
    """A trained run's ``doc_losses.parquet``; ``FileNotFoundError`` naming the folder when absent
    (a diverged run, or a run trained without each validation token's document)."""
    path = Path(out_dir) / DOC_LOSSES_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{Path(out_dir)}: no {DOC_LOSSES_FILE}; train it again with the validation "
                                "split's document index (the train flow passes it), or delete the folder")
    return pl.read_parquet(path)


def train_model(
    spec: RunSpec,
    cfg: TrainingConfig,
    train_tokens: np.ndarray,
    val_tokens: np.ndarray,
    out_dir: str | Path,
    *,
    on_metrics: MetricsCallback | None = None,
    progress: ProgressCallback | None = None,
    device: torch.device | str | None = None,
    init_checkpoint: str | Path | None = None,
    val_groups: np.ndarray | None = None,
    val_docs: np.ndarray | None = None,
    parallel: WorkerGroup | None = None,
) -> TrainResult:
    """Train ``spec`` on ``train_tokens`` (flat token stream, shape (n,)), validate on ``val_tokens``.

    Per optimizer step: ``grad_accum`` micro-batches of ``batch_size`` x ``seq_len`` tokens, mean
    next-token cross-entropy (RePB-weighted over the whole step when ``cfg.repb.enabled``),
    global-norm clipping, AdamW (fused on CUDA) at :func:`lr_at`. bf16 autocast on CUDA, fp32 on
    CPU. Validation loss (:func:`tasks.lm.loss.evaluate_loss` on the first ``eval_tokens``)
    every ``eval_interval`` steps and at the end (the curve); the point's ``val_loss`` is the final
    model's mean over the whole validation split (:func:`score_validation`, one pass).
    ``val_groups`` (shape of ``val_tokens``, a label per token such as its source) adds the final
    model's loss per label over every validation token (``val_loss_by_group``); ``val_docs`` (shape
    of ``val_tokens``, each token's document index) writes its loss per document to
    ``out_dir/doc_losses.parquet`` before ``result.json``.

    ``init_checkpoint`` (a WSD branch): when the run has no checkpoint of its own, start from this
    stable-run checkpoint folder (its step must be ``spec.decay_start``) instead of step 0.

    ``on_metrics(metrics, step)`` gets ``train_loss``, ``lr``, ``tokens_per_s`` every
    ``log_interval`` steps, plus ``val_loss`` when evaluated; ``progress(step, total_steps)`` after
    every step. Resumes from ``out_dir/checkpoint`` when present; returns the stored result without
    training when ``out_dir/result.json`` exists (raises if it came from a different config).

    A stored result from before the full-split scoring (no ``val_tokens``), or without
    ``doc_losses.parquet`` when ``val_docs`` is given, is rescored from its ``model.safetensors``
    (one pass over the validation split, no training) and its ``result.json`` rewritten with the
    full-split ``val_loss``: the weights are the same run's, only the scoring was older.

    ``parallel``: this process is one of W workers training the run together
    (:mod:`tasks.training.distributed`); every worker calls this, only the first writes files.
    """
    out_dir = Path(out_dir)
    main = parallel is None or parallel.is_main
    fingerprint = run_fingerprint(spec, cfg)
    result_path = out_dir / RESULT_FILE
    if result_path.exists():
        stored = read_json(result_path)
        if stored.get("fingerprint") != fingerprint:
            raise ValueError(f"{result_path}: written by a different config or spec "
                             f"({stored.get('fingerprint')} != {fingerprint}); delete {out_dir} to retrain")
        stale = stored.get("val_tokens") is None or (val_docs is not None and not (out_dir / DOC_LOSSES_FILE).exists())
        if stored.get("diverged") or not stale or not main:
            return TrainResult.from_dict(stored)
        return _rescore_stored(out_dir, stored, val_tokens, device, val_groups=val_groups, val_docs=val_docs)

    trainer = _Trainer(spec, cfg, train_tokens, val_tokens, device, val_groups, val_docs, parallel)
    ckpt_dir = out_dir / "checkpoint"
    config_path = out_dir / CONFIG_FILE
    if config_path.exists() and read_json(config_path).get("fingerprint") != fingerprint:
        raise ValueError(f"{config_path}: an unfinished run of a different config or spec is in "
                         f"{out_dir}; delete it to retrain")
    if main:
        write_json(config_path, _config_record(spec, cfg, trainer.model, fingerprint))
    if not trainer.restore(ckpt_dir, fingerprint, "run") and init_checkpoint is not None:
        if not trainer.restore(Path(init_checkpoint), stable_fingerprint(spec, cfg), "stable-run"):
            raise FileNotFoundError(f"{init_checkpoint}: no stable-run checkpoint to branch {spec.name} from")
        if trainer.step != spec.decay_start:
            raise ValueError(f"{init_checkpoint}: stable checkpoint at step {trainer.step}, but {spec.name} "
                             f"branches at step {spec.decay_start}")
    trainer.run(spec.steps, fingerprint=fingerprint, ckpt_dir=ckpt_dir, on_metrics=on_metrics, progress=progress)
    if trainer.val_loss is None and not trainer.diverged:  # unreachable while the last step evaluates; a guard
        trainer.evaluate()
    result = trainer.result()
    # FSDP: gathering the full weights is collective, every worker takes part
    weights = parallel.full_state_dict(trainer.model) if parallel is not None else trainer.model.state_dict()
    if main:
        if not trainer.diverged:
            write_weights(out_dir, weights, name=spec.name)
            if trainer.doc_losses is not None:
                write_doc_losses(out_dir / DOC_LOSSES_FILE, trainer.doc_losses)
        write_json(result_path, {**result.to_dict(), "fingerprint": fingerprint})
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    if parallel is not None:  # no worker looks for result.json before the first has written it
        parallel.barrier()
    return result


def _rescore_stored(out_dir: Path, stored: dict[str, Any], val_tokens: np.ndarray,
                    device: torch.device | str | None, *, val_groups: np.ndarray | None,
                    val_docs: np.ndarray | None) -> TrainResult:
    """Score a complete run's saved model over the whole validation split; rewrite its records."""
    model, meta = load_model(out_dir, _resolve_device(device))
    score = score_validation(model, val_tokens, meta["seq_len"], meta["training"]["batch_size"], device,
                             val_groups=val_groups, val_docs=val_docs)
    if score.doc_losses is not None:
        write_doc_losses(out_dir / DOC_LOSSES_FILE, score.doc_losses)
    updated = {**stored, "val_loss": score.val_loss, "ppl": perplexity(score.val_loss), "val_tokens": score.val_tokens}
    if score.by_group is not None:
        updated["val_loss_by_group"] = score.by_group
    write_json(out_dir / RESULT_FILE, updated)
    return TrainResult.from_dict(updated)


def train_stable(spec: RunSpec, cfg: TrainingConfig, train_tokens: np.ndarray, val_tokens: np.ndarray,
                 stable_dir: str | Path, branch_points: list[int], *, progress: ProgressCallback | None = None,
                 device: torch.device | str | None = None, parallel: WorkerGroup | None = None) -> Path:
    """The stable phase of one size under WSD: train to the last of ``branch_points`` at constant lr.

    ``spec`` is the size's longest budget (its schedule before any branch point is every budget's).
    Keeps a checkpoint at each branch point in ``stable_dir/branches/<step>/`` and writes
    ``stable_dir/stable.json`` when done; resumes from ``stable_dir/checkpoint``. Returns
    ``stable_dir/branches``. ``parallel``: as :func:`train_model`.
    """
    stable_dir = Path(stable_dir)
    fingerprint = stable_fingerprint(spec, cfg)
    branches = stable_dir / "branches"
    marker = stable_dir / "stable.json"
    points = tuple(sorted(set(branch_points)))
    if marker.exists():
        done = read_json(marker)
        if (done.get("fingerprint") == fingerprint and set(points) <= set(done.get("branch_points", []))
                and all(checkpoint_files(branches / f"{p:08d}") for p in points)):
            return branches
    trainer = _Trainer(spec, cfg, train_tokens, val_tokens, device, parallel=parallel)
    ckpt_dir = stable_dir / "checkpoint"
    trainer.restore(ckpt_dir, fingerprint, "stable-run")
    # a branch point already passed by a checkpoint from an older ladder is not in branches/: restart
    if any(p <= trainer.step and not checkpoint_files(branches / f"{p:08d}") for p in points):
        trainer = _Trainer(spec, cfg, train_tokens, val_tokens, device, parallel=parallel)
    trainer.run(points[-1], fingerprint=fingerprint, ckpt_dir=ckpt_dir, on_metrics=None, progress=progress,
                keep_steps=points, keep_dir=branches)
    if trainer.diverged:
        raise FloatingPointError(f"{stable_dir}: the stable run diverged ({trainer.diverged})")
    if parallel is None or parallel.is_main:
        write_json(marker, {"fingerprint": fingerprint, "branch_points": list(points), "steps": trainer.step,
                            "tokens": trainer.step * spec.tokens_per_step,
                            "flops": trainer.step * spec.tokens_per_step * spec.flops_per_token,
                            "wall_s": trainer.prior_wall + time.perf_counter() - trainer.t_start})
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    if parallel is not None:
        parallel.barrier()
    return branches


def train_size_wsd(specs: list[RunSpec], cfg: TrainingConfig, train_tokens: np.ndarray, val_tokens: np.ndarray,
                   out_dirs: list[str | Path], stable_dir: str | Path, *,
                   on_metrics: Callable[[RunSpec], MetricsCallback | None] | None = None,
                   progress: Callable[[RunSpec], ProgressCallback | None] | None = None,
                   device: torch.device | str | None = None, val_groups: np.ndarray | None = None,
                   val_docs: np.ndarray | None = None, keep_stable: bool = False,
                   parallel: WorkerGroup | None = None) -> list[TrainResult]:
    """Every budget of one size under WSD: one stable run, then a cooldown branch per budget.

    ``specs`` (one shape) and ``out_dirs`` pair up. Branches whose result exists are skipped; when
    all are done the stable run's checkpoints are removed (``keep_stable`` keeps them).
    Returns the results in the order of ``specs``. ``parallel``: as :func:`train_model`.
    """
    if len({s.size for s in specs}) != 1:
        raise ValueError(f"train_size_wsd: one size at a time, got {sorted({s.size for s in specs})}")
    if cfg.schedule != "wsd":
        raise ValueError(f"train_size_wsd needs schedule: wsd, got {cfg.schedule!r}")
    todo = [s for s, d in zip(specs, out_dirs) if not (Path(d) / RESULT_FILE).exists()]
    branches = None
    if todo:
        longest = max(specs, key=lambda s: s.steps)
        branches = train_stable(longest, cfg, train_tokens, val_tokens, stable_dir, stable_steps(todo),
                                progress=progress(longest) if progress else None, device=device,
                                parallel=parallel)
    results = []
    for spec, out_dir in zip(specs, out_dirs):
        init = branches / f"{spec.decay_start:08d}" if branches is not None else None
        results.append(train_model(spec, cfg, train_tokens, val_tokens, out_dir, init_checkpoint=init,
                                   on_metrics=on_metrics(spec) if on_metrics else None,
                                   progress=progress(spec) if progress else None, device=device,
                                   val_groups=val_groups, val_docs=val_docs, parallel=parallel))
    if not keep_stable and (parallel is None or parallel.is_main):
        shutil.rmtree(Path(stable_dir) / "branches", ignore_errors=True)
    return results
