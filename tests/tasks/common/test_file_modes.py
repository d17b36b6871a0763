"""Every kind of writer scalelab uses leaves the mode a plain write gives under the umask: 0644 files,
0755 folders under 022 (``mkstemp``/``mkdtemp`` alone would leave 0600/0700, unreadable to other
users, a web server or a DVC remote sync). The atomic helpers themselves: test_io.py."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest


@pytest.fixture()
def umask_022():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def unusual_modes(root: Path) -> list[str]:
    """Every file not 0644 and every folder not 0755 under ``root`` (itself included), as 'path mode'."""
    bad = []
    for path in [root, *root.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode != (0o755 if path.is_dir() else 0o644):
            bad.append(f"{path.relative_to(root.parent)} {mode:o}")
    return bad


def test_plots_saved_by_matplotlib(tmp_path: Path, umask_022):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tasks.scaling.report import _save

    fig, ax = plt.subplots()
    ax.plot([1, 2], [3, 4])
    _save(fig, tmp_path / "reports" / "plots" / "frontier.png")
    plt.close(fig)
    assert (tmp_path / "reports" / "plots" / "frontier.png").stat().st_size > 0
    assert unusual_modes(tmp_path / "reports") == []


def test_compressed_model_files_and_exported_folders(tmp_path: Path, umask_022):
    from tasks.compression.registry import compress
    from tasks.zoo.compressed import export_dequantized, save_compressed
    from tasks.compression.rtn import RTNConfig
    from tests.tasks.compression.test_rtn import tiny_llama

    model = tiny_llama()
    out = tmp_path / "compressed"
    # as the compress stage lays them out: <variant>/<run>/<setting>.safetensors
    save_compressed(compress(model, RTNConfig(bits=4, group_size=32)), out / "raw" / "d16" / "rtn_w4_g32.safetensors")
    export_dequantized(model, out / "raw" / "d16" / "dequantized")
    assert (out / "raw" / "d16" / "dequantized" / "config.json").exists()
    assert unusual_modes(out) == []


def test_mlflow_artifacts_and_summary_files(tmp_path: Path, umask_022):
    from tasks.common.io import write_text
    from tasks.common.tracking import tracked_run

    report = write_text(tmp_path / "reports" / "summary.md", "# found\n")
    with tracked_run("pipeline", uri=f"sqlite:///{tmp_path / 'mlflow.db'}", experiment="modes") as run:
        run.log_artifact(report, "reports")
    artifacts = tmp_path / "mlartifacts"
    assert list(artifacts.rglob("summary.md")), "the artifact was not stored under mlartifacts/"
    assert unusual_modes(artifacts) == [] and unusual_modes(tmp_path / "reports") == []
