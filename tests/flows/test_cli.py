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


def test_fit_command_with_a_variant_column_also_fits_jointly(tmp_path: Path):
    import json

    import numpy as np

    rng = np.random.default_rng(1)
    n = np.repeat([1e6, 3e6, 1e7, 3e7], 4)
    d = np.tile([2e7, 6e7, 2e8, 6e8], 4)
    frames = []
    for name, e in (("raw", 1.7), ("filtered", 1.6)):  # the same shape, E lower by 0.1
        loss = e + 400 / n**0.34 + 410 / d**0.28 + rng.normal(0, 0.002, n.size)
        frames.append(pl.DataFrame({"variant": name, "N": n, "D": d, "loss": loss}))
    pl.concat(frames).write_csv(tmp_path / "points.csv")
    out = tmp_path / "out"
    assert main(["fit", "--points", str(tmp_path / "points.csv"), "--out", str(out), "--root", str(ROOT),
                 "--preset", "ci"]) == 0
    fits = json.loads((out / "fits.json").read_text())
    joint = fits["decisions"]["joint"]["params"]
    assert joint["raw"]["alpha"] == joint["filtered"]["alpha"]
    assert joint["filtered"]["E"] - joint["raw"]["E"] == pytest.approx(-0.1, abs=0.03)
    rows = pl.read_csv(out / "decisions.csv")
    assert set(rows["kind"]) == {"projected"} and set(rows["decision"]) == {"better"}
    assert (out / "decisions_filtered.png").exists()


def test_fit_command_names_a_missing_column(tmp_path: Path, capsys):
    pl.DataFrame({"N": [1.0], "loss": [2.0]}).write_csv(tmp_path / "p.csv")
    assert main(["fit", "--points", str(tmp_path / "p.csv"), "--out", str(tmp_path / "o"), "--root", str(ROOT), "--preset", "ci"]) != 0
    err = capsys.readouterr().err
    assert "p.csv" in err and "D" in err


def test_check_params_command(capsys):
    assert main(["check-params", "--root", str(ROOT)]) == 0
    assert "params OK" in capsys.readouterr().out


def test_run_creates_a_new_nested_workdir_with_spaces_relative_to_the_current_folder(tmp_path: Path, monkeypatch, capsys):
    # `scalelab run prepare --workdir "new dir/a/wd"` from tmp_path: every folder is new.
    monkeypatch.chdir(tmp_path)
    for key in ("PREFECT_HOME", "PREFECT_API_URL"):  # set first, so the teardown restores the original state
        monkeypatch.setenv(key, "x")
        monkeypatch.delenv(key)
    assert main(["run", "prepare", "--preset", "ci", "--root", str(ROOT), "--workdir", "new dir/a/wd"]) == 0
    wd = tmp_path / "new dir" / "a" / "wd"
    assert f"scalelab: workdir {wd}" in capsys.readouterr().out
    assert (wd / "data" / "prepared" / "val.parquet").exists() and (wd / ".prefect").is_dir()
    assert not list(wd.glob(".scalelab-write-probe-*"))


@pytest.mark.parametrize("case", ["is_a_file", "under_a_file", "read_only"])
def test_a_bad_workdir_fails_at_once_naming_the_path(tmp_path: Path, case, capsys):
    import os

    if case == "is_a_file":
        (tmp_path / "wd").write_text("x")
        wd, reason = tmp_path / "wd", "exists and is not a folder"
    elif case == "under_a_file":
        (tmp_path / "f").write_text("x")
        wd, reason = tmp_path / "f" / "wd", f"{tmp_path / 'f'} is a file"
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only folders")
        (tmp_path / "ro").mkdir(mode=0o555)
        wd, reason = tmp_path / "ro" / "wd", "not writable (Permission denied)"
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert main(["run", "prepare", "--preset", "ci", "--root", str(ROOT), "--workdir", str(wd)]) == 2
    err = capsys.readouterr().err
    assert f"workdir {wd}" in err and reason in err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written


def test_ensure_workdir_refuses_a_folder_it_cannot_write(tmp_path: Path, monkeypatch):
    # the permission probe itself, independent of who runs the test
    import tempfile

    from flows.runtime import WorkdirError, ensure_workdir

    def deny(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", deny)
    with pytest.raises(WorkdirError, match=r"not writable \(Permission denied\)"):
        ensure_workdir(tmp_path / "wd")


def test_an_unusable_prefect_home_is_named_at_once(tmp_path: Path, monkeypatch, capsys):
    (tmp_path / "f").write_text("x")
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "f" / "home"))
    assert main(["run", "prepare", "--preset", "ci", "--root", str(ROOT), "--workdir", str(tmp_path / "wd")]) == 2
    err = capsys.readouterr().err
    assert f"PREFECT_HOME {tmp_path / 'f' / 'home'}: cannot be created, {tmp_path / 'f'} is a file" in err
