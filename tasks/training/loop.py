"""Train one rung of the ladder: AdamW, warmup + cosine, resumable checkpoints, validation loss.

A run is fully determined by (config, spec, token arrays): the weights by ``build_model``'s seed,
the data order by ``(seed, step)`` (see :class:`WindowSampler`), the learning rate by the step
(:func:`lr_at`); nothing else draws random numbers (dropout is 0). A checkpoint holds the
weights, AdamW's tensors and every piece of loop state, so a run killed at any point and started
again reaches the same final loss, bit for bit on CPU.

Outputs in ``out_dir``::

    config.json          resolved TrainingConfig + HF model config + spec + arch (written first)
    checkpoint/          state-<step>.safetensors + state-<step>.json while the run is in progress
    model.safetensors    final weights
    result.json          TrainResult; its presence marks the run complete (a sweep skips it)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from tasks.common.config import to_dict
from tasks.common.io import atomic_path, read_json, write_json
from tasks.evaluation.loss import evaluate_loss
from tasks.training.config import ModelShape, TrainingConfig
from tasks.training.model import build_model, count_non_embedding_params, model_flops_per_token, peak_flops
from tasks.training.repb import RePBSelector

MetricsCallback = Callable[[dict[str, float], int], None]
ProgressCallback = Callable[[int, int], None]


# --------------------------------------------------------------------------------------------
# The ladder


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One (model size, token budget) point. ``tokens`` is the budget D asked for; the run trains
    ``steps * tokens_per_step`` tokens (the budget rounded to whole steps, at least one)."""

    name: str
    size: str
    shape: ModelShape
    tokens: int
    n_params: int  # non-embedding N
    steps: int
    tokens_per_step: int

    @property
    def tokens_trained(self) -> int:
        return self.steps * self.tokens_per_step

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunSpec:
        return cls(**{**d, "shape": ModelShape(**d["shape"])})


def run_name(shape: ModelShape, tokens: int) -> str:
    """``d64_l2_D200000``: the shape tag and the token budget."""
    return f"{shape.tag}_D{tokens}"


def ladder(cfg: TrainingConfig) -> list[RunSpec]:
    """Every (size, budget) pair of the config, ordered by N then D."""
    specs = []
    per_step = cfg.tokens_per_step
    for shape in cfg.sizes:
        n = count_non_embedding_params(shape, cfg.vocab_size, cfg.arch, cfg.seq_len)
        for tokens in cfg.token_budgets:
            steps = max(1, round(tokens / per_step))
            specs.append(RunSpec(name=run_name(shape, tokens), size=shape.tag, shape=shape, tokens=tokens,
                                 n_params=n, steps=steps, tokens_per_step=per_step))
    return sorted(specs, key=lambda s: (s.n_params, s.tokens))


# --------------------------------------------------------------------------------------------
# Schedule and data order


def warmup_steps(total_steps: int, warmup_frac: float) -> int:
    return min(total_steps - 1, math.ceil(warmup_frac * total_steps)) if warmup_frac > 0 else 0


def lr_at(step: int, total_steps: int, cfg: TrainingConfig) -> float:
    """Learning rate of 0-based optimizer step ``step`` of a ``total_steps`` run.

    Linear warmup ``lr * (step+1) / W`` for ``step < W``, then cosine from ``lr`` to
    ``lr * min_lr_ratio`` reached at the last step: ``lr_min + (lr - lr_min) * (1 + cos(pi p)) / 2``,
    ``p = (step - W) / (total_steps - 1 - W)``.
    """
    w = warmup_steps(total_steps, cfg.warmup_frac)
    if step < w:
        return cfg.lr * (step + 1) / w
    lr_min = cfg.lr * cfg.min_lr_ratio
    span = total_steps - 1 - w
    p = (step - w) / span if span > 0 else 1.0
    return lr_min + (cfg.lr - lr_min) * 0.5 * (1.0 + math.cos(math.pi * min(p, 1.0)))


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
    """One trained point. ``tokens`` is D actually trained; ``val_loss`` the final validation loss (nats)."""

    name: str
    n_params: int
    tokens: int
    steps: int
    val_loss: float
    ppl: float
    tokens_per_s: float
    flops_6nd: float
    flops_attn: float
    wall_s: float
    mfu: float | None
    history: list[tuple[int, float, float | None]] = field(default_factory=list)
    repb_kept_frac: float | None = None

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


def run_fingerprint(spec: RunSpec, cfg: TrainingConfig) -> str:
    """Hash of everything that changes a run's numbers (not the ladder lists or checkpoint cadence)."""
    c = to_dict(cfg)
    # Performance knobs are left out: they change float summation order, not what the run is.
    for k in ("sizes", "token_budgets", "variants", "checkpoint_interval", "compile", "num_threads"):
        c.pop(k, None)
    blob = json.dumps({"cfg": c, "spec": spec.to_dict()}, sort_keys=True)
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


def _checkpoint_files(ckpt_dir: Path) -> list[tuple[int, Path, Path]]:
    """Complete checkpoints (both files present), oldest first. The JSON is written last."""
    out = []
    for js in ckpt_dir.glob("state-*.json"):
        st = js.with_suffix(".safetensors")
        try:
            step = int(js.stem.split("-")[1])
        except (IndexError, ValueError):
            continue
        if st.exists():
            out.append((step, st, js))
    return sorted(out)


def save_checkpoint(ckpt_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    meta: dict[str, Any], extra_tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """Write ``state-<step>.safetensors`` (model + AdamW tensors) then ``state-<step>.json``, atomically.

    AdamW's per-parameter state ``{exp_avg, exp_avg_sq, step}`` is flattened to tensors named
    ``optim.<param index>.<key>``; its param groups and non-tensor state go in the JSON. Older
    checkpoints are removed once the new one is complete.
    """
    tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    sd = optimizer.state_dict()
    scalar_state: dict[str, dict[str, Any]] = {}
    for idx, st in sd["state"].items():
        for key, value in st.items():
            if torch.is_tensor(value):
                tensors[f"optim.{idx}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalar_state.setdefault(str(idx), {})[key] = value
    for k, v in (extra_tensors or {}).items():
        tensors[k] = v.detach().cpu().contiguous()
    st_path = ckpt_dir / f"state-{step:08d}.safetensors"
    with atomic_path(st_path) as tmp:
        save_file(tensors, str(tmp), metadata={"step": str(step)})
    js_path = write_json(ckpt_dir / f"state-{step:08d}.json", {
        **meta, "step": step, "optim_param_groups": sd["param_groups"], "optim_scalar_state": scalar_state,
    })
    for old_step, old_st, old_js in _checkpoint_files(ckpt_dir):
        if old_step != step:
            old_js.unlink(missing_ok=True)
            old_st.unlink(missing_ok=True)
    return js_path


def load_checkpoint(ckpt_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer
                    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
    """Restore the newest complete checkpoint into ``model`` and ``optimizer``.

    Returns ``(meta, other_tensors)`` — the JSON and tensors not belonging to model or optimizer —
    or None when there is none.
    """
    files = _checkpoint_files(ckpt_dir) if ckpt_dir.exists() else []
    if not files:
        return None
    step, st_path, js_path = files[-1]
    meta = read_json(js_path)
    tensors = load_file(str(st_path), device="cpu")
    model.load_state_dict({k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}, strict=True)
    state: dict[int, dict[str, Any]] = {}
    for k, v in tensors.items():
        if k.startswith("optim."):
            _, idx, key = k.split(".", 2)
            state.setdefault(int(idx), {})[key] = v
    for idx, scalars in meta["optim_scalar_state"].items():
        state.setdefault(int(idx), {}).update(scalars)
    optimizer.load_state_dict({"state": state, "param_groups": meta["optim_param_groups"]})
    others = {k: v for k, v in tensors.items() if not k.startswith(("model.", "optim."))}
    return meta, others


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
) -> TrainResult:
    """Train ``spec`` on ``train_tokens`` (flat token stream, shape (n,)), validate on ``val_tokens``.

    Per optimizer step: ``grad_accum`` micro-batches of ``batch_size`` x ``seq_len`` tokens, mean
    next-token cross-entropy (RePB-weighted when ``cfg.repb.enabled``), global-norm clipping,
    AdamW (fused on CUDA) at :func:`lr_at`. bf16 autocast on CUDA, fp32 on CPU. Validation loss
    (:func:`tasks.evaluation.loss.evaluate_loss` on the first ``eval_tokens``) every
    ``eval_interval`` steps and at the end; the last one is the point's loss.

    ``on_metrics(metrics, step)`` gets ``train_loss``, ``lr``, ``tokens_per_s`` every
    ``log_interval`` steps, plus ``val_loss`` when evaluated; ``progress(step, total_steps)`` after
    every step. Resumes from ``out_dir/checkpoint`` when present; returns the stored result without
    training when ``out_dir/result.json`` exists (raises if it came from a different config).
    """
    out_dir = Path(out_dir)
    fingerprint = run_fingerprint(spec, cfg)
    result_path = out_dir / "result.json"
    if result_path.exists():
        stored = read_json(result_path)
        if stored.get("fingerprint") != fingerprint:
            raise ValueError(f"{result_path}: written by a different config or spec "
                             f"({stored.get('fingerprint')} != {fingerprint}); delete {out_dir} to retrain")
        return TrainResult.from_dict(stored)

    if cfg.num_threads > 0:
        previous_threads = torch.get_num_threads()
        torch.set_num_threads(cfg.num_threads)
        try:
            return _train(spec, cfg, train_tokens, val_tokens, out_dir, fingerprint, on_metrics, progress, device)
        finally:
            torch.set_num_threads(previous_threads)
    return _train(spec, cfg, train_tokens, val_tokens, out_dir, fingerprint, on_metrics, progress, device)


def _train(spec: RunSpec, cfg: TrainingConfig, train_tokens: np.ndarray, val_tokens: np.ndarray, out_dir: Path,
           fingerprint: str, on_metrics: MetricsCallback | None, progress: ProgressCallback | None,
           device: torch.device | str | None) -> TrainResult:
    result_path = out_dir / "result.json"
    t_start = time.perf_counter()
    device = _resolve_device(device)
    for label, arr in (("train_tokens", train_tokens), ("val_tokens", val_tokens)):
        if len(arr) and int(np.max(arr)) >= cfg.vocab_size:
            raise ValueError(f"{label}: token id {int(np.max(arr))} >= vocab_size {cfg.vocab_size}")
    sampler = WindowSampler(len(train_tokens), cfg.seq_len, cfg.seed)

    model = build_model(spec.shape, cfg.vocab_size, cfg.seq_len, cfg.arch, cfg.seed).to(device)
    model.train()
    forward_model = torch.compile(model) if cfg.compile else model
    optimizer = _optimizer(model, cfg, device)
    selector = RePBSelector(cfg.repb) if cfg.repb.enabled else None
    params = [p for p in model.parameters() if p.requires_grad]

    ckpt_dir = out_dir / "checkpoint"
    config_path = out_dir / "config.json"
    if config_path.exists() and read_json(config_path).get("fingerprint") != fingerprint:
        raise ValueError(f"{config_path}: an unfinished run of a different config or spec is in "
                         f"{out_dir}; delete it to retrain")
    write_json(config_path, _config_record(spec, cfg, model, fingerprint))

    start_step = 0
    history: list[tuple[int, float, float | None]] = []
    train_time = 0.0  # seconds in training steps (not eval, not checkpoint), over all attempts
    prior_wall = 0.0  # wall seconds of earlier, interrupted attempts
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)  # train loss since the last log point
    loss_count = 0
    val_loss: float | None = None
    loaded = load_checkpoint(ckpt_dir, model, optimizer)
    if loaded is not None:
        meta, others = loaded
        if meta.get("fingerprint") != fingerprint:
            raise ValueError(f"{ckpt_dir}: checkpoint of a different config or spec; delete it to retrain")
        start_step = int(meta["step"])
        history = [tuple(h) for h in meta["history"]]
        train_time = float(meta["train_time_s"])
        prior_wall = float(meta["wall_s"])
        loss_sum.fill_(float(meta["loss_sum"]))
        loss_count = int(meta["loss_count"])
        val_loss = meta["val_loss"]
        if selector is not None:
            selector.load_state(others, meta["repb"])

    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else torch.autocast("cpu", enabled=False))
    b, accum, total = cfg.batch_size, cfg.grad_accum, spec.steps
    t_segment = time.perf_counter()
    for step in range(start_step, total):
        lr = lr_at(step, total, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        for micro in range(accum):
            ids, x, y = sampler.batch(train_tokens, (step * accum + micro) * b, b)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast:
                logits = forward_model(input_ids=x, use_cache=False).logits
            if selector is None:
                loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
                loss_sum += loss.detach()
                (loss / accum).backward()
            else:
                per_token = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1),
                                            reduction="none").view(y.shape)
                per_sample = per_token.mean(dim=1)
                loss_sum += per_sample.detach().mean()  # the unpruned batch loss, comparable across runs
                (selector.weighted_loss(per_sample, ids) / accum).backward()
            loss_count += 1
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        done = step + 1

        is_eval = done % cfg.eval_interval == 0 or done == total
        is_log = done % cfg.log_interval == 0 or is_eval
        is_ckpt = cfg.checkpoint_interval > 0 and done % cfg.checkpoint_interval == 0 and done < total
        if is_log or is_ckpt:
            now = time.perf_counter()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                now = time.perf_counter()
            train_time += now - t_segment
            t_segment = now
        if is_log:
            train_loss = float(loss_sum) / max(loss_count, 1)
            loss_sum.zero_()
            loss_count = 0
            metrics = {"train_loss": train_loss, "lr": lr, "tokens_per_s": done * spec.tokens_per_step / max(train_time, 1e-9)}
            point_val = None
            if is_eval:
                val_loss = evaluate_loss(model, val_tokens, cfg.seq_len, cfg.batch_size, cfg.eval_tokens, device)
                point_val = val_loss
                metrics["val_loss"] = val_loss
                model.train()
            history.append((done, train_loss, point_val))
            if on_metrics is not None:
                on_metrics(metrics, done)
        if is_ckpt:
            meta = {
                "fingerprint": fingerprint, "steps": total, "lr": lr, "history": [list(h) for h in history],
                "train_time_s": train_time, "wall_s": prior_wall + time.perf_counter() - t_start,
                "loss_sum": float(loss_sum), "loss_count": loss_count, "val_loss": val_loss,
                "repb": selector.state_scalars() if selector is not None else None,
            }
            save_checkpoint(ckpt_dir, done, model, optimizer, meta,
                            selector.state_tensors() if selector is not None else None)
        if is_log or is_ckpt:
            t_segment = time.perf_counter()
        if progress is not None:
            progress(done, total)

    if val_loss is None:  # unreachable while the last step always evaluates; kept as a guard
        val_loss = evaluate_loss(model, val_tokens, cfg.seq_len, cfg.batch_size, cfg.eval_tokens, device)

    with atomic_path(out_dir / "model.safetensors") as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, str(tmp),
                  metadata={"format": "pt", "name": spec.name})
    flops = model_flops_per_token(spec.shape, cfg.seq_len, cfg.vocab_size, cfg.arch)
    d = spec.tokens_trained
    tokens_per_s = d / max(train_time, 1e-9)
    peak = peak_flops(device)
    result = TrainResult(
        name=spec.name, n_params=spec.n_params, tokens=d, steps=total, val_loss=val_loss,
        ppl=math.exp(val_loss), tokens_per_s=tokens_per_s, flops_6nd=flops.dense * d,
        flops_attn=flops.attention * d, wall_s=prior_wall + time.perf_counter() - t_start,
        mfu=(flops.total * tokens_per_s / peak) if peak else None, history=history,
        repb_kept_frac=selector.kept_fraction if selector is not None else None,
    )
    write_json(result_path, {**result.to_dict(), "fingerprint": fingerprint})
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    return result


def load_model(out_dir: str | Path, device: torch.device | str = "cpu") -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild a trained model from ``config.json`` + ``model.safetensors`` (no pickle).

    Returns ``(model in eval mode, meta)``; ``meta`` is config.json's record (``arch``, ``vocab_size``,
    ``seq_len``, ``spec``, ``training``, ``model_config``) plus ``result`` when result.json exists.
    """
    out_dir = Path(out_dir)
    meta = read_json(out_dir / "config.json")
    spec = RunSpec.from_dict(meta["spec"])
    model = build_model(spec.shape, meta["vocab_size"], meta["seq_len"], meta["arch"], seed=0)
    model.load_state_dict(load_file(str(out_dir / "model.safetensors"), device="cpu"), strict=True)
    model.to(device).eval()
    if (out_dir / "result.json").exists():
        meta["result"] = read_json(out_dir / "result.json")
    return model, meta
