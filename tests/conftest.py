"""Session-wide test settings: no GPU, no network, every writable path under a temp folder."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"

_home = Path(tempfile.mkdtemp(prefix="scalelab-tests-"))
# Replaced, not defaulted: the Makefile exports PREFECT_HOME=$(CURDIR)/.prefect for `make demo`, and a
# user's shell may point PREFECT_API_URL at a server or MLFLOW_TRACKING_URI at the project's store; the
# tests (and every subprocess they start) must add no flow run or MLflow run there. Prefect reads these
# when it is first imported, so this runs before any test module imports it.
os.environ["PREFECT_HOME"] = str(_home / "prefect")
os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{_home / 'mlflow.db'}"
for _name in ("PREFECT_API_URL", "PREFECT_API_KEY", "PREFECT_PROFILES_PATH", "SCALELAB_PARENT_RUN_ID",
              "SCALELAB_RAY_ADDRESS", "SCALELAB_FAULT"):
    os.environ.pop(_name, None)
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
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


from tests.checkout_state import state_changes, state_snapshot  # noqa: E402
from tests.scheduling import make_scheduler  # noqa: E402

_state_before = state_snapshot(ROOT)


@pytest.hookimpl(optionalhook=True)  # only a hook where pytest-xdist is installed
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (`make test`): a file's tests on one worker, the ci pipeline's files together
    (tests/scheduling.py)."""
    return make_scheduler(config, log)


def pytest_sessionfinish(session, exitstatus):
    """Fail the session if the checkout's own state (.prefect/, mlflow.db, data/, models/, reports/, ...)
    changed while it ran: tests write under temporary folders only (tests/checkout_state.py)."""
    changes = state_changes(_state_before, state_snapshot(ROOT))
    if changes:
        shown = "\n  ".join(changes[:20]) + (f"\n  ... {len(changes) - 20} more" if len(changes) > 20 else "")
        session.config.get_terminal_writer().line(
            f"\nERROR: the test session changed the checkout's own state under {ROOT} (tests must write under "
            f"tmp_path; see tests/checkout_state.py), or something else ran in this checkout meanwhile (make demo):\n  {shown}", red=True, bold=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
