"""Watching how many documents the main process holds: the sharded engine's memory tests."""

from __future__ import annotations

from types import ModuleType

import polars as pl


def watch_document_frames(monkeypatch, engine: ModuleType, *, join: bool = False,
                          ignore_column: str | None = None) -> list[int]:
    """Patch polars' ``read_parquet``, ``concat``, ``DataFrame.filter`` (and ``DataFrame.join`` with
    ``join``) and ``engine.write_parquet`` so every frame with a ``text`` column they take or give
    in this process records its height; returns a one-item list holding the largest seen. Frames
    with ``ignore_column`` (e.g. a rewriter's own results) are not counted."""
    largest = [0]

    def watch(fn):
        def wrapped(*args, **kwargs):
            res = fn(*args, **kwargs)
            for f in (res, *args):
                if isinstance(f, pl.DataFrame) and "text" in f.columns and ignore_column not in f.columns:
                    largest[0] = max(largest[0], f.height)
            return res
        return wrapped

    monkeypatch.setattr(pl, "read_parquet", watch(pl.read_parquet))
    monkeypatch.setattr(pl, "concat", watch(pl.concat))
    monkeypatch.setattr(engine, "write_parquet", watch(engine.write_parquet))
    monkeypatch.setattr(pl.DataFrame, "filter", watch(pl.DataFrame.filter))
    if join:
        monkeypatch.setattr(pl.DataFrame, "join", watch(pl.DataFrame.join))
    return largest
