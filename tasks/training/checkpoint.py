"""Resumable training checkpoints: model and AdamW tensors in ``state-<step>.safetensors``, the
loop's state in ``state-<step>.json`` (written last, so a checkpoint is complete when both exist).

Only the train stage reads them; a finished run's weights are in the model folder
(:mod:`tasks.zoo.ladder`).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tasks.common.faults import fault_point
from tasks.common.io import atomic_path, read_json, write_json


def checkpoint_files(ckpt_dir: Path) -> list[tuple[int, Path, Path]]:
    """Complete checkpoints (both parts present), oldest first. The JSON is written last.

    The tensors are ``state-<step>.safetensors``, or a ``state-<step>.dcp/`` folder of
    ``torch.distributed.checkpoint`` shards when FSDP wrote it (:mod:`tasks.training.distributed`).
    """
    out = []
    for js in ckpt_dir.glob("state-*.json"):
        st = js.with_suffix(".safetensors")
        if not st.exists():
            st = js.with_suffix(".dcp")
        try:
            step = int(js.stem.split("-")[1])
        except (IndexError, ValueError):
            continue
        if st.exists():
            out.append((step, st, js))
    return sorted(out)


def remove_older_checkpoints(ckpt_dir: Path, step: int) -> None:
    """Delete every complete checkpoint of ``ckpt_dir`` but ``step``'s (once ``step``'s is complete)."""
    for old_step, old_st, old_js in checkpoint_files(ckpt_dir):
        if old_step != step:
            old_js.unlink(missing_ok=True)
            if old_st.is_dir():
                shutil.rmtree(old_st, ignore_errors=True)
            else:
                old_st.unlink(missing_ok=True)


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
    fault_point("train.checkpoint")
    js_path = write_json(ckpt_dir / f"state-{step:08d}.json", {
        **meta, "step": step, "optim_param_groups": sd["param_groups"], "optim_scalar_state": scalar_state,
    })
    remove_older_checkpoints(ckpt_dir, step)
    return js_path


def load_checkpoint(ckpt_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer
                    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
    """Restore the newest complete checkpoint into ``model`` and ``optimizer``.

    Returns ``(meta, other_tensors)`` — the JSON and tensors not belonging to model or optimizer —
    or None when there is none.
    """
    files = checkpoint_files(ckpt_dir) if ckpt_dir.exists() else []
    if not files:
        return None
    step, st_path, js_path = files[-1]
    if st_path.suffix == ".dcp":
        raise ValueError(f"{st_path}: a sharded checkpoint written under training.parallel: fsdp; resume it with "
                         "parallel: fsdp, or delete it to restart this run")
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
