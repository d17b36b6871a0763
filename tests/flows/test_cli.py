from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from flows.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]


def test_parser_knows_every_stage():
    args = build_parser().parse_args(["run", "all", "--preset", "ci", "--workdir", "/tmp/x"])
    assert (args.stage, args.preset, args.workdir) == ("all", "ci", "/tmp/x")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "nope"])


def test_fit_command_writes_fits(tmp_path: Path):
    import numpy as np

    rng = np.random.default_rng(0)
    n = np.repeat([1e6, 3e6, 1e7, 3e7], 4)
    d = np.tile([2e7, 6e7, 2e8, 6e8], 4)
    loss = (1.7 + 400 / n**0.34 + 410 / d**0.28) * np.exp(rng.normal(0, 0.002, n.size))
    pl.DataFrame({"N": n, "D": d, "loss": loss}).write_csv(tmp_path / "points.csv")
    assert main(["fit", "--points", str(tmp_path / "points.csv"), "--out", str(tmp_path / "out"), "--root", str(ROOT), "--preset", "ci"]) == 0
    assert (tmp_path / "out" / "fits.json").exists()


def test_fit_command_names_a_missing_column(tmp_path: Path, capsys):
    pl.DataFrame({"N": [1.0], "loss": [2.0]}).write_csv(tmp_path / "p.csv")
    assert main(["fit", "--points", str(tmp_path / "p.csv"), "--out", str(tmp_path / "o"), "--root", str(ROOT), "--preset", "ci"]) != 0
    err = capsys.readouterr().err
    assert "p.csv" in err and "D" in err


def test_check_params_command(capsys):
    assert main(["check-params", "--root", str(ROOT)]) == 0
    assert "params OK" in capsys.readouterr().out
