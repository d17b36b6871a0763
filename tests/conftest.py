"""Session-wide test settings: no GPU, no network, every writable path under a temp folder."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"

_home = Path(tempfile.mkdtemp(prefix="scalelab-tests-"))
os.environ.setdefault("PREFECT_HOME", str(_home / "prefect"))
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{_home / 'mlflow.db'}")
os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")
# Kernels run in Triton's interpreter on CPU; it must be set before any @triton.jit is defined.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
