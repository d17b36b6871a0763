"""Bad input at every entry point: an error naming the file and the line, key or column; nothing changed.

One table per entry point (issue 13, item 4). Each case writes the bad input, runs the command a
user would, and checks the exit status, that the message names the file and the place, and that
the output folder is exactly as it was before (absent, or holding only what was there).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from flows.cli import main

ROOT = Path(__file__).resolve().parents[2]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` with its bytes (empty when the folder does not exist)."""
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def refused(argv: list[str], out: Path, capsys) -> str:
    """Run ``scalelab argv``; assert exit 2 and ``out`` unchanged; return stderr."""
    before = snapshot(out)
    assert main(argv) == 2
    assert snapshot(out) == before, f"{out} changed"
    return capsys.readouterr().err


# ------------------------------------------------------------------------- scalelab fit --points

def good_points() -> pl.DataFrame:
    n = np.repeat([1e6, 3e6, 1e7], 3)
    d = np.tile([2e7, 6e7, 2e8], 3)
    loss = 1.7 + 400 / n**0.34 + 410 / d**0.28
    return pl.DataFrame({"N": n, "D": d, "loss": loss})


def set_cell(frame: pl.DataFrame, col: str, row: int, value) -> pl.DataFrame:
    values = frame[col].cast(pl.Utf8).to_list()
    values[row] = value
    return frame.with_columns(pl.Series(col, values))


FIT_CASES = {
    # case: (make the CSV text, pattern that must appear in the message)
    "missing column": (lambda: good_points().drop("D"), r"missing column 'D'"),
    "NaN loss": (lambda: set_cell(good_points(), "loss", 3, "NaN"), r"line 5: loss=nan"),
    "negative N": (lambda: set_cell(good_points(), "N", 0, "-1"), r"line 2: N=-1"),
    "zero D": (lambda: set_cell(good_points(), "D", 7, "0"), r"line 9: D=0"),
    "not a number": (lambda: set_cell(good_points(), "N", 2, "1e6x"), r"line 4: N='1e6x' is not a number"),
    "empty loss": (lambda: set_cell(good_points(), "loss", 1, None), r"line 3: loss is empty"),
    "duplicated rows": (lambda: pl.concat([good_points(), good_points()[4:5]]), r"line 6 is repeated at line 11"),
    "single model size": (lambda: good_points().with_columns(pl.lit(1e6).alias("N")).unique(["D"]),
                          r"single model size \(N=1e\+06 at line 2"),
}


@pytest.mark.parametrize("case", sorted(FIT_CASES))
def test_fit_refuses_bad_points_naming_file_and_line(tmp_path: Path, case: str, capsys):
    make, pattern = FIT_CASES[case]
    points = tmp_path / "points.csv"
    make().write_csv(points)
    out = tmp_path / "out"
    err = refused(["fit", "--points", str(points), "--out", str(out), "--root", str(ROOT), "--preset", "ci"], out, capsys)
    assert str(points) in err
    assert re.search(pattern, err), err


def test_fit_refusal_keeps_an_existing_report(tmp_path: Path, capsys):
    """A good fit, then a bad points file to the same --out: the first report stays as it was."""
    out = tmp_path / "out"
    good_points().write_csv(tmp_path / "good.csv")
    assert main(["fit", "--points", str(tmp_path / "good.csv"), "--out", str(out), "--root", str(ROOT), "--preset", "ci"]) == 0
    capsys.readouterr()
    set_cell(good_points(), "loss", 0, "-2").write_csv(tmp_path / "bad.csv")
    err = refused(["fit", "--points", str(tmp_path / "bad.csv"), "--out", str(out), "--root", str(ROOT), "--preset", "ci"], out, capsys)
    assert "bad.csv" in err and "line 2" in err
    assert (out / "fits.json").exists()


# ------------------------------------------------------------------------------ scalelab curate

def write_empty(path: Path) -> Path:
    path.write_bytes(b"")
    return path


def write_folder(path: Path) -> Path:
    path.mkdir()
    (path / "a.jsonl").write_text(json.dumps({"text": "hello world"}) + "\n")
    return path


def write_parquet_without_text(path: Path) -> Path:
    path = path.with_suffix(".parquet")
    pl.DataFrame({"id": ["a", "b"], "body": ["first document", "second document"]}).write_parquet(path)
    return path


CURATE_CASES = {
    "empty file": (write_empty, r"empty file \(no documents\)"),
    "a directory": (write_folder, r"is a directory"),
    "parquet without text": (write_parquet_without_text, r"no 'text' column"),
}


@pytest.mark.parametrize("case", sorted(CURATE_CASES))
def test_curate_refuses_bad_input_naming_the_file(tmp_path: Path, case: str, capsys):
    make, pattern = CURATE_CASES[case]
    path = make(tmp_path / "input.jsonl")
    out = tmp_path / "curated"
    err = refused(["curate", "--input", str(path), "--out", str(out), "--recipe", "exact_dedup",
                   "--root", str(ROOT), "--preset", "ci"], out, capsys)
    assert str(path) in err
    assert re.search(pattern, err), err


# ------------------------------------------------------------------------- a trained-model folder

@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    """A tiny model folder written by the training loop itself (8 steps on a random token stream)."""
    from tasks.training.config import TrainingConfig
    from tasks.lm.model import ModelShape
    from tasks.training.loop import train_model
    from tasks.training.design import ladder

    cfg = TrainingConfig(vocab_size=256, seq_len=16, sizes=(ModelShape(d_model=16, n_layers=1, n_heads=2),),
                         token_budgets=(512,), batch_size=4, eval_interval=8, eval_tokens=256,
                         checkpoint_interval=0, seed=0, num_threads=1)
    tokens = np.random.default_rng(0).integers(0, 256, 4096).astype(np.uint16)
    folder = tmp_path_factory.mktemp("model")
    train_model(ladder(cfg)[0], cfg, tokens[:3072], tokens[3072:], folder)
    return folder


def truncate(folder: Path) -> None:
    w = folder / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])


def tamper_header(folder: Path) -> None:
    w = folder / "model.safetensors"
    raw = bytearray(w.read_bytes())
    raw[8:16] = b"#garbage"
    w.write_bytes(bytes(raw))


def widen_config(folder: Path) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg["spec"]["shape"]["d_model"] = 32
    (folder / "config.json").write_text(json.dumps(cfg))


def drop_spec(folder: Path) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["spec"]
    (folder / "config.json").write_text(json.dumps(cfg))


MODEL_CASES = {
    "truncated weights": (truncate, "model.safetensors", r"not a readable safetensors file"),
    "tampered header": (tamper_header, "model.safetensors", r"not a readable safetensors file"),
    "config wider than weights": (widen_config, "model.safetensors", r"shape"),
    "config without spec": (drop_spec, "config.json", r"not a trained model's config"),
}


@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_a_broken_model_folder_is_refused_before_loading(model_folder: Path, tmp_path: Path, case: str):
    from tasks.zoo.ladder import load_model

    damage, named, pattern = MODEL_CASES[case]
    folder = tmp_path / "model"
    shutil.copytree(model_folder, folder)
    load_model(folder)  # the copy is good before it is damaged
    damage(folder)
    before = snapshot(folder)
    with pytest.raises(ValueError, match=pattern) as info:
        load_model(folder)
    assert str(folder / named) in str(info.value)
    assert snapshot(folder) == before


# ------------------------------------------------------------------------------------ params files

PARAMS_CASES = {
    # file, text replaced, replacement, pattern (file:line: key: problem)
    "string for a float": ("fit.yaml", "huber_delta: 1.0e-3", "huber_delta: lots",
                           r"fit\.yaml:\d+: fit\.huber_delta: expected float, got str 'lots'"),
    "list for an int in a nested setting": (
        "compression.yaml", "rtn_w4_g32: {method: rtn, bits: 4,", "rtn_w4_g32: {method: rtn, bits: [4, 3],",
        r"compression\.yaml:\d+: compression\.settings\.rtn_w4_g32\.bits: expected int, got list"),
    "mapping for a list": ("training.yaml", "token_budgets: [8192, 16384, 32768]", "token_budgets: {a: 8192}",
                           r"training\.yaml:\d+: training\.token_budgets"),
    "a key given twice": ("fit.yaml", "fit:\n", "fit:\n  n_jobs: 1\n", r"fit\.yaml:\d+: fit\.n_jobs: repeated"),
}


@pytest.mark.parametrize("case", sorted(PARAMS_CASES))
def test_a_wrong_typed_params_value_is_named_by_file_line_and_key(tmp_path: Path, case: str, capsys):
    name, old, new, pattern = PARAMS_CASES[case]
    shutil.copytree(ROOT / "params", tmp_path / "params")
    path = tmp_path / "params" / name
    assert old in path.read_text()
    path.write_text(path.read_text().replace(old, new, 1))
    before = snapshot(tmp_path / "params")
    assert main(["check-params", "--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert re.search(pattern, err), err
    assert snapshot(tmp_path / "params") == before


# ----------------------------------------------------------------------- scalelab microbench --matrix

MATRIX_CSV = "model,q1,q2,q3\nalpha,1,0,1\nbeta,0,0,1\ngamma,1,1,1\ndelta,0,1,1\n"

MICROBENCH_CASES = {
    # case: (CSV text, --sizes, pattern that must appear in the message)
    "not 0 or 1": (MATRIX_CSV.replace("beta,0,0,1", "beta,0,0.5,1"), "2",
                   r"line 3, column 3 \('q2'\): '0.5' is not 0 or 1"),
    "empty cell": (MATRIX_CSV.replace("gamma,1,1,1", "gamma,1,,1"), "2", r"line 4, column 3 \('q2'\): empty cell"),
    "repeated model": (MATRIX_CSV + "beta,1,1,1\n", "2", r"line 6, column 1 \('model'\): model 'beta' is repeated"),
    "one model": ("model,q1,q2\nalpha,1,0\n", "1", r"1 model\(s\); ranking needs at least 2"),
    "size beyond the items": (MATRIX_CSV, "2,5", r"--sizes: 5 is larger than the 3 items of"),
}


@pytest.mark.parametrize("case", sorted(MICROBENCH_CASES))
def test_microbench_refuses_a_bad_matrix_naming_file_line_and_column(tmp_path: Path, case: str, capsys):
    text, sizes, pattern = MICROBENCH_CASES[case]
    matrix = tmp_path / "matrix.csv"
    matrix.write_text(text)
    out = tmp_path / "mb"
    err = refused(["microbench", "--matrix", str(matrix), "--sizes", sizes, "--out", str(out), "--root", str(ROOT)],
                  out, capsys)
    assert str(matrix) in err
    assert re.search(pattern, err), err
