"""Provenance tags: the code's git commit and dirty flag, the stage's params files and their hash."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tasks.common.provenance import GIT_COMMIT, GIT_DIRTY, PARAMS_HASH, params_hash, source_tags, stage_params_files


def test_source_tags_name_the_commit_and_hash_the_stage_params(tmp_path: Path):
    (tmp_path / "params").mkdir()
    (tmp_path / "params" / "pipeline.yaml").write_text("pipeline: {}\n")
    (tmp_path / "params" / "training.yaml").write_text("training: {lr: 0.1}\n")
    (tmp_path / "params" / "fit.yaml").write_text("fit: {}\n")
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"train": {
        "cmd": "x", "params": [{"params/pipeline.yaml": None}, {"params/training.yaml": None}]}}}))
    files = stage_params_files(tmp_path, "train")
    assert [f.name for f in files] == ["pipeline.yaml", "training.yaml"]
    assert len(stage_params_files(tmp_path, "pipeline")) == 3  # not a DVC stage: every params file
    tags = source_tags(tmp_path, "train")
    before = tags[PARAMS_HASH]
    (tmp_path / "params" / "fit.yaml").write_text("fit: {changed: 1}\n")  # not train's: same hash
    assert source_tags(tmp_path, "train")[PARAMS_HASH] == before
    (tmp_path / "params" / "training.yaml").write_text("training: {lr: 0.2}\n")
    assert source_tags(tmp_path, "train")[PARAMS_HASH] != before
    repo = Path(__file__).resolve().parents[3]
    if (repo / ".git").exists():  # this checkout's commit; the flag is a boolean string
        assert len(tags[GIT_COMMIT]) == 40 and tags[GIT_DIRTY] in ("true", "false")
    with pytest.raises(FileNotFoundError, match="gone.yaml"):
        params_hash([tmp_path / "params" / "gone.yaml"])
