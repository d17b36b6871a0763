"""A compressed model on disk: one ``.safetensors`` file of stored tensors with a JSON header
(``method``, resolved config, per-tensor layout, the base model's shapes), and the way back to an
evaluable model: :func:`load_compressed_model` rebuilds it onto its base model with the method's
decoder from :mod:`tasks.zoo.decoders`.

The compression methods (:mod:`tasks.compression`) write these files; any stage, the CLI and the
MLflow model read them here without importing the methods.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from tasks.common.config import to_dict
from tasks.common.io import atomic_dir, atomic_path
from tasks.zoo.decoders import get_decoder


@dataclass
class CompressedModel:
    """What a compression method returns.

    ``model``: ready for evaluation, with dequantized (or pruned) weights in place, in the original
    dtype. ``tensors``: what goes on disk (packed integer codes, fp16 scales/zeros, untouched
    parameters), written by :func:`save_compressed`. ``meta``: JSON-friendly description (method,
    resolved config, per-tensor layout) saved with the tensors.
    """

    model: nn.Module
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)


_META_KEY = "scalelab"


def save_compressed(cm: CompressedModel, path: str | Path) -> int:
    """Write ``cm.tensors`` and ``cm.meta`` as one safetensors file, atomically; return its size in bytes.

    The size is ``bytes_on_disk``: measured from the file, header included.
    """
    tensors = {k: v.detach().contiguous().cpu() for k, v in cm.tensors.items()}
    meta = json.dumps(to_dict(cm.meta), allow_nan=False, sort_keys=True)
    path = Path(path)
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={_META_KEY: meta})
    return path.stat().st_size


def _header(fh: Any) -> dict[str, Any]:
    return json.loads((fh.metadata() or {}).get(_META_KEY, "{}"))


def load_compressed(path: str | Path, device: str | torch.device = "cpu") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read a file written by :func:`save_compressed`: ``(tensors, meta)``."""
    with safe_open(str(path), framework="pt", device=str(device)) as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}, _header(fh)


def compressed_meta(path: str | Path) -> dict[str, Any]:
    """The ``meta`` of a file written by :func:`save_compressed`, read from its header alone."""
    with safe_open(str(path), framework="pt", device="cpu") as fh:
        return _header(fh)


def diagnostic(value: float | None, digits: int = 6) -> float | None:
    """A computed float stored in an artifact's metadata, rounded to ``digits`` significant digits.

    Such values (proxy losses, weight errors) differ in their last bits between thread counts; the
    header is padded to 8 bytes, so a longer ``repr`` would change ``bytes_on_disk`` between two
    otherwise identical runs.
    """
    return None if value is None else float(f"{value:.{digits}g}")


def base_fingerprint(model: nn.Module) -> dict[str, Any]:
    """What an artifact records of the model it came from, so loading onto another model is refused.

    ``class`` (the model's class name), ``n_params`` and ``shapes`` (every state-dict entry's shape).
    """
    return {
        "class": type(model).__name__,
        "n_params": int(sum(t.numel() for t in unique_state(model)[0].values())),
        "shapes": {k: list(v.shape) for k, v in model.state_dict().items()},
    }


def load_compressed_model(path: str | Path, base_model: nn.Module, **options: Any) -> nn.Module:
    """The evaluable (dequantized) model from a file written by :func:`save_compressed`.

    ``base_model`` is the uncompressed model the artifact came from (left unchanged): it supplies the
    architecture; every one of its tensors is replaced from the file. ``options`` go to the method's
    dequantizer (``bits=3`` picks the precision of an AnyBCQ artifact). Returns a copy of
    ``base_model`` in eval mode, in the dtypes the artifact records, whose logits equal those of
    the :class:`CompressedModel` that was saved.

    Raises ``ValueError`` naming the file when its metadata is missing, it was made from a model
    of another shape, or a stored tensor does not match its layout; ``KeyError`` for an unknown method.

    >>> save_compressed(compress(model, RTNConfig(bits=4)), "m.safetensors")   # doctest: +SKIP
    >>> qmodel = load_compressed_model("m.safetensors", model)                 # doctest: +SKIP
    """
    tensors, meta = load_compressed(path)
    try:
        return model_from_tensors(tensors, meta, base_model, **options)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def model_from_tensors(tensors: dict[str, torch.Tensor], meta: dict[str, Any], base_model: nn.Module,
                       **options: Any) -> nn.Module:
    """What :func:`load_compressed_model` does once the file is read (also used on a
    :class:`CompressedModel`'s own ``tensors``/``meta``, e.g. to serve another AnyBCQ precision)."""
    if not meta or "method" not in meta:
        raise ValueError("no scalelab metadata (not written by save_compressed, or truncated)")
    base = meta.get("base")
    if base is not None:
        shapes = {k: list(v.shape) for k, v in base_model.state_dict().items()}
        if base.get("shapes") != shapes:
            diff = sorted(k for k in set(shapes) | set(base.get("shapes", {}))
                          if shapes.get(k) != base.get("shapes", {}).get(k))
            raise ValueError(
                f"made from a {base.get('class')} with {base.get('n_params')} parameters whose "
                f"shapes differ from the base model given ({type(base_model).__name__}) at {diff[:3]}"
            )
    try:
        state = get_decoder(meta["method"])(tensors, meta, **options)
    except KeyError as exc:
        if "no decoder" in str(exc):
            raise
        raise ValueError(f"missing tensor {exc} for method {meta['method']!r}") from None
    except TypeError as exc:
        raise ValueError(f"{meta['method']}: {exc}") from None
    model = copy.deepcopy(base_model)
    expected = model.state_dict()
    for k, v in state.items():
        if k in expected and tuple(expected[k].shape) != tuple(v.shape):
            raise ValueError(f"{k} has shape {tuple(v.shape)}, the base model's is {tuple(expected[k].shape)}")
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"tensors do not match the base model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.load_state_dict(state, strict=True)
    return model.eval()


def export_dequantized(model: nn.Module, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write a (dequantized) transformers model as a plain ``save_pretrained`` folder (safetensors).

    ``from_pretrained(out_dir)`` loads it in any tool; ``dtype`` (e.g. ``torch.bfloat16``) casts first.
    """
    out = Path(out_dir)
    m = copy.deepcopy(model).to(dtype) if dtype is not None else model
    if not hasattr(m, "save_pretrained"):
        raise TypeError(f"{type(model).__name__} is not a transformers model (no save_pretrained)")
    with atomic_dir(out) as tmp:
        m.save_pretrained(str(tmp))
    return out


def unique_state(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The state dict with tied tensors stored once: ``(tensors, {alias: name stored})``.

    safetensors refuses shared storage; tied embeddings (``lm_head.weight`` is
    ``embed_tokens.weight``) are the usual case.
    """
    seen: dict[tuple[int, tuple[int, ...], tuple[int, ...]], str] = {}
    tensors: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        if t.numel() and key in seen:
            tied[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = t
    return tensors, tied
