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
