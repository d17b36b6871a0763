from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from tasks.common.io import atomic_path, read_json, write_json, write_parquet


def test_failed_write_leaves_previous_file_and_no_temp(tmp_path: Path):
    target = tmp_path / "out.json"
    write_json(target, {"v": 1})
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed")
    assert read_json(target) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_parquet_round_trip_creates_parents(tmp_path: Path):
    frame = pl.DataFrame({"id": ["a", "b"], "text": ["x", "y"]})
    path = write_parquet(tmp_path / "deep" / "f.parquet", frame)
    assert pl.read_parquet(path).equals(frame)


def test_nan_is_refused_not_written(tmp_path: Path):
    with pytest.raises(ValueError):
        write_json(tmp_path / "m.json", {"loss": float("nan")})
    assert not (tmp_path / "m.json").exists()


def test_clean_temporaries_removes_leftovers_and_restores_a_folder_caught_mid_swap(tmp_path: Path):
    from tasks.common.io import clean_temporaries

    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "train.csv").write_text("a\n")
    (tmp_path / "reports" / ".train.csv.abc123.tmp").write_text("half")
    (tmp_path / "models" / "compressed" / ".raw.x1y2.tmp").mkdir(parents=True)
    (tmp_path / "models" / "compressed" / ".raw.x1y2.tmp" / "w.safetensors").write_text("half")
    # a kill between atomic_dir's two renames: the old copy is aside, the new one never arrived
    (tmp_path / "data" / ".curated.old-4242").mkdir(parents=True)
    (tmp_path / "data" / ".curated.old-4242" / "kept.parquet").write_text("complete")
    # an old copy whose replacement did arrive is just removed
    (tmp_path / "data" / "tokens").mkdir()
    (tmp_path / "data" / ".tokens.old-17").mkdir()
    out = clean_temporaries(tmp_path)
    assert sorted(p.name for p in out["removed"]) == [".raw.x1y2.tmp", ".tokens.old-17", ".train.csv.abc123.tmp"]
    assert out["restored"] == [tmp_path / "data" / "curated"]
    assert (tmp_path / "data" / "curated" / "kept.parquet").read_text() == "complete"
    assert sorted(p.name for p in (tmp_path / "reports").iterdir()) == ["train.csv"]
    assert clean_temporaries(tmp_path) == {"removed": [], "restored": []}


def test_atomic_writes_keep_the_mode_a_plain_write_gives(tmp_path: Path):
    import os
    import stat

    from tasks.common.io import atomic_dir, write_text

    old = os.umask(0o022)
    try:
        write_text(tmp_path / "a.txt", "x")
        with atomic_dir(tmp_path / "folder") as d:
            write_text(d / "b.txt", "y")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.txt").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "folder").stat().st_mode) == 0o755
    assert stat.S_IMODE((tmp_path / "folder" / "b.txt").stat().st_mode) == 0o644
