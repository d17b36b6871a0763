"""A trained ladder model's folder: ``config.json`` + ``model.safetensors`` (+ ``result.json``).

The train stage (:mod:`tasks.training.loop`) writes these folders; every stage after it, the CLI
and the MLflow model read them through :func:`load_model`. No pickle: ``config.json`` holds the
architecture (``arch``, ``vocab_size``, ``seq_len``, the run ``spec`` with its ``shape``) and the
weights are checked against it before they are loaded (:func:`check_weights`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from tasks.common.io import atomic_path, read_json
from tasks.lm.model import ModelShape, build_model

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
RESULT_FILE = "result.json"


def write_weights(out_dir: str | Path, weights: Mapping[str, torch.Tensor], *, name: str) -> Path:
    """Write ``weights`` (a state dict) as ``out_dir/model.safetensors``, atomically."""
    path = Path(out_dir) / WEIGHTS_FILE
    with atomic_path(path) as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()}, str(tmp),
                  metadata={"format": "pt", "name": name})
    return path


def check_weights(path: Path, model: nn.Module) -> None:
    """Refuse ``path`` before loading when it cannot be the weights of ``model``.

    Reads only the safetensors header (the library checks it against the file's size, so a
    truncated file fails here) and compares every tensor's name, shape and dtype with the model
    built from config.json. ``ValueError`` names the file and the first difference.
    """
    if not path.is_file():
        raise FileNotFoundError(f"{path}: weights not found")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            stored = {k: (tuple(fh.get_slice(k).get_shape()), fh.get_slice(k).get_dtype()) for k in fh.keys()}
    except Exception as exc:  # noqa: BLE001 — safetensors raises its own error types for bad headers
        raise ValueError(f"{path}: not a readable safetensors file, truncated or tampered ({exc})") from None
    expected = {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in model.state_dict().items()}
    names = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I64": "int64"}
    for key in sorted(expected.keys() | stored.keys()):
        if key not in stored:
            raise ValueError(f"{path}: no tensor {key!r}, which config.json's model has")
        if key not in expected:
            raise ValueError(f"{path}: tensor {key!r} is not in config.json's model")
        shape, dtype = stored[key]
        if shape != expected[key][0]:
            raise ValueError(f"{path}: {key} has shape {list(shape)}, config.json's model expects "
                             f"{list(expected[key][0])} (config.json does not match the weights)")
        if names.get(dtype, dtype) != expected[key][1]:
            raise ValueError(f"{path}: {key} is {dtype}, config.json's model expects {expected[key][1]}")


def load_model(out_dir: str | Path, device: torch.device | str = "cpu") -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild a trained model from ``config.json`` + ``model.safetensors`` (no pickle).

    Returns ``(model in eval mode, meta)``; ``meta`` is config.json's record (``arch``, ``vocab_size``,
    ``seq_len``, ``spec``, ``training``, ``model_config``) plus ``result`` when result.json exists.
    """
    out_dir = Path(out_dir)
    meta = read_json(out_dir / CONFIG_FILE)
    try:
        shape = ModelShape(**meta["spec"]["shape"])
        model = build_model(shape, meta["vocab_size"], meta["seq_len"], meta["arch"], seed=0)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{out_dir / CONFIG_FILE}: not a trained model's config ({type(exc).__name__}: {exc})") from None
    weights = out_dir / WEIGHTS_FILE
    check_weights(weights, model)
    model.load_state_dict(load_file(str(weights), device="cpu"), strict=True)
    model.to(device).eval()
    if (out_dir / RESULT_FILE).exists():
        meta["result"] = read_json(out_dir / RESULT_FILE)
    return model, meta
