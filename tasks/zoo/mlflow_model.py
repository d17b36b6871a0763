"""The MLflow pyfunc of a scalelab model: loads the safetensors from the workdir, so the MLflow
store holds a few kB per model, not the weights (MLflow's "models from code": this file is logged
with each model and run at load time).

    model = mlflow.pyfunc.load_model("models:/raw@best-32768")
    logits = model.predict(np.array([[1, 2, 3]]))        # (batch, seq) token ids -> (batch, seq, vocab)
    torch_model = model.unwrap_python_model().model      # the nn.Module itself

``model_config`` (set per model by :func:`tasks.common.lineage.log_model_ref`):
``{"kind": "trained", "model_dir": ...}``, ``{"kind": "compressed", "file": ..., "base_dir": ...
| "base": "smollm2", "bits": ...}`` or ``{"kind": "pruned", "model_dir": ...}`` (a ``from_pretrained``
folder the prune stage kept in ``models/pruned/``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlflow.pyfunc
import numpy as np
import torch
from mlflow.models import set_model
from torch import nn

from tasks.zoo.models import load_causal_lm


class ScalelabLM(mlflow.pyfunc.PythonModel):
    """A causal LM from the workdir; ``predict`` maps token ids to logits (float32 numpy)."""

    model: Any = None

    def load_context(self, context) -> None:
        self.model = load_lm(dict(context.model_config or {}))

    def predict(self, context, model_input, params=None):
        ids = np.asarray(getattr(model_input, "values", model_input), dtype=np.int64)
        if ids.ndim == 1:
            ids = ids[None, :]
        with torch.no_grad():
            out = self.model(torch.from_numpy(ids))
        logits = out.logits if hasattr(out, "logits") else out
        return logits.float().numpy()


def load_lm(config: dict[str, Any]) -> nn.Module:
    """The ``nn.Module`` a logged model's ``model_config`` names (eval mode, CPU), loaded by the zoo's
    one loader, :func:`tasks.zoo.models.load_causal_lm`.

    Raises ``ValueError`` naming the key when the config is not one of the three kinds, and
    ``FileNotFoundError`` naming the path when the workdir no longer holds the weights.
    """
    kind = config.get("kind")
    paths = [config[k] for k in ("model_dir", "file", "base_dir") if config.get(k)]
    for p in paths:
        if not Path(p).exists():
            raise FileNotFoundError(f"{p}: the weights this logged model points to are gone (model_config {config})")
    if kind in ("trained", "pruned"):
        return load_causal_lm(config["model_dir"], tokenizer=False)[0]
    if kind == "compressed":
        base = config.get("base_dir") or config.get("base")
        if not base:
            raise ValueError(f"model_config {config}: a compressed model needs `base_dir` or `base`")
        options = {"bits": int(config["bits"])} if config.get("multi_precision") else {}
        return load_causal_lm(config["file"], base=base, tokenizer=False, **options)[0]
    raise ValueError(f"model_config.kind {kind!r}: expected 'trained', 'compressed' or 'pruned'")


set_model(ScalelabLM())
