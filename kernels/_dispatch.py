"""Which implementation of a kernel runs: compiled Triton, Triton's CPU interpreter, or the torch reference.

Rules (first match wins):

1. ``SCALELAB_TRITON=reference`` forces the torch reference everywhere.
2. ``SCALELAB_TRITON=interpret`` or ``TRITON_INTERPRET=1`` runs the Triton kernels in Triton's
   interpreter (on CPU tensors; slow, meant for tests). Triton reads ``TRITON_INTERPRET`` when a
   ``@triton.jit`` function is *defined*, so importing :mod:`kernels` with
   ``SCALELAB_TRITON=interpret`` sets ``TRITON_INTERPRET=1`` before any kernel module is imported.
3. A CUDA tensor runs the compiled Triton kernel.
4. Anything else (CPU tensors) runs the torch reference.

A missing Triton never fails a run: the reference is used and one warning says how to install it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import warnings
from types import ModuleType
from typing import Literal, NamedTuple

import torch

BackendName = Literal["triton", "interpret", "reference"]

_INSTALL_HINT = "install it with `pip install triton==3.7.1` (the version paired with torch 2.13.0)"


class Backend(NamedTuple):
    """``name`` is what runs; ``reason`` says why, for logs and test ids."""

    name: BackendName
    reason: str


def _requested() -> str:
    value = os.environ.get("SCALELAB_TRITON", "auto").strip().lower() or "auto"
    if value not in ("auto", "triton", "interpret", "reference"):
        raise ValueError(
            f"SCALELAB_TRITON={value!r}: expected one of auto, triton, interpret, reference"
        )
    return value


def interpreter_requested() -> bool:
    """True when the environment asks for Triton's interpreter."""
    return _requested() == "interpret" or os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _warn_missing_triton(wanted: str) -> None:
    warnings.warn(
        f"Triton is not installed, so the {wanted} kernels fall back to the torch reference; "
        f"{_INSTALL_HINT}.",
        RuntimeWarning,
        stacklevel=3,
    )


def backend(device: torch.device | str | None = None) -> Backend:
    """The implementation a kernel call on ``device`` should use, with the reason.

    >>> backend("cpu")            # without SCALELAB_TRITON / TRITON_INTERPRET
    Backend(name='reference', reason='CPU tensor: Triton kernels need CUDA (set SCALELAB_TRITON=interpret to run them interpreted)')
    """
    requested = _requested()
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if requested == "reference":
        return Backend("reference", "SCALELAB_TRITON=reference")
    if interpreter_requested():
        if not triton_available():
            _warn_missing_triton("interpreted")
            return Backend("reference", f"interpreter requested but Triton is missing; {_INSTALL_HINT}")
        src = "SCALELAB_TRITON=interpret" if requested == "interpret" else "TRITON_INTERPRET=1"
        return Backend("interpret", f"{src}: Triton kernels run in the CPU interpreter")
    if dev.type == "cuda":
        if not triton_available():
            _warn_missing_triton("CUDA")
            return Backend("reference", f"CUDA tensor but Triton is missing; {_INSTALL_HINT}")
        return Backend("triton", "CUDA tensor: compiled Triton kernel")
    if requested == "triton":
        raise RuntimeError(
            f"SCALELAB_TRITON=triton but the tensor is on {dev}; compiled Triton kernels need CUDA "
            "(use SCALELAB_TRITON=interpret to run them on CPU)"
        )
    return Backend(
        "reference",
        "CPU tensor: Triton kernels need CUDA (set SCALELAB_TRITON=interpret to run them interpreted)",
    )


def check_interpreted(module_interpreted: bool, op: str) -> None:
    """Fail clearly when the interpreter is asked for after ``op``'s kernels were compiled-mode defined."""
    if not module_interpreted:
        raise RuntimeError(
            f"kernels.{op}: the Triton interpreter was requested, but its kernels were defined before "
            "TRITON_INTERPRET=1 was set; set SCALELAB_TRITON=interpret or TRITON_INTERPRET=1 before "
            "importing kernels (tests/conftest.py does this)"
        )


def implementation(op: str, device: torch.device | str | None = None) -> ModuleType:
    """The module whose functions a call of ``kernels.<op>`` on ``device`` runs: ``kernels.<op>.reference``,
    or ``kernels.<op>.triton`` (compiled, or interpreted after :func:`check_interpreted`). Both modules
    define the op's functions with the same signatures."""
    name = backend(device).name
    if name == "reference":
        return importlib.import_module(f"kernels.{op}.reference")
    module = importlib.import_module(f"kernels.{op}.triton")
    if name == "interpret":
        check_interpreted(module.INTERPRETED, op)
    return module


# Set the interpreter flag before any kernel module defines a @triton.jit function.
if _requested() == "interpret":
    os.environ["TRITON_INTERPRET"] = "1"
