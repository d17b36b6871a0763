"""`scalelab curate` on a user's own corpus: records with other keys, the e-mail recipe, the token
counter named in stats.json, the params' sources, and any working folder (packaged params)."""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path

import polars as pl
import pytest
import yaml

from flows.cli import main
from tasks.common.config import ConfigError, from_mapping
from tasks.common.params import PACKAGED_ROOT
from tasks.curation.crawl import BpeTokenCount
from tasks.curation.recipes import CurationConfig
from tasks.training.tokenizer import train_tokenizer
from tests.tasks.curation.test_mail import GMAIL_FORWARD, ONLY_QUOTED, REPLY

ROOT = Path(__file__).resolve().parents[2]


def write_mail(path: Path) -> Path:
    """Three messages as a user's export might hold them: text under `body`, ids under `meta.id`."""
    rows = [{"body": REPLY, "meta": {"id": "a1"}}, {"body": ONLY_QUOTED, "meta": {"id": "a2"}},
            {"body": GMAIL_FORWARD, "meta": {"id": "a3"}}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_curate_runs_from_any_folder_on_records_with_other_keys(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no params/ here: the packaged defaults are used
    write_mail(tmp_path / "mail.jsonl")
    assert main(["curate", "--input", "mail.jsonl", "--text-field", "body", "--id-field", "meta.id",
                 "--out", "out", "--recipe", "email", "--workers", "1"]) == 0
    printed = capsys.readouterr().out
    assert f"params: {PACKAGED_ROOT / 'params'}" in printed and "by words" in printed
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["dropped_by_reason"] == {"email_body.empty": 1}
    assert stats["token_count"] == "words" and stats["tokens_kept"] == stats["words_kept"]
    kept = pl.read_parquet(tmp_path / "out" / "kept.parquet")
    assert kept["id"].to_list() == ["a1", "a3"]
    assert kept["text"][1] == "Fwd: trip\n\nLook at this."  # the recipe keeps the subject
    assert not (tmp_path / "params").exists()


def test_the_packaged_params_are_the_projects_and_ship_in_the_wheel():
    assert (PACKAGED_ROOT / "params").resolve() == (ROOT / "params").resolve()
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["tasks.common"]
    shipped = {p.name for g in globs for p in (PACKAGED_ROOT.parent).glob(g)}
    assert shipped == {p.name for p in (ROOT / "params").iterdir() if p.is_file()}


def test_the_token_counter_is_a_choice_named_in_stats(tmp_path: Path, capsys):
    mail = write_mail(tmp_path / "mail.jsonl")
    tok = tmp_path / "tok.json"
    train_tokenizer([REPLY, GMAIL_FORWARD, ONLY_QUOTED] * 20, 300).save(str(tok))
    out = tmp_path / "out"
    assert main(["curate", "--input", str(mail), "--text-field", "body", "--out", str(out), "--recipe", "email",
                 "--workers", "1", "--token-count", f"tokenizer:{tok}", "--root", str(ROOT), "--preset", "ci"]) == 0
    stats = json.loads((out / "stats.json").read_text())
    assert stats["token_count"] == f"tokenizer:{tok.resolve()}"
    kept = pl.read_parquet(out / "kept.parquet")["text"]
    assert stats["tokens_kept"] == int(BpeTokenCount(tok)(kept).sum()) != stats["words_kept"]

    capsys.readouterr()
    assert main(["curate", "--input", str(mail), "--text-field", "body", "--out", str(tmp_path / "o2"),
                 "--recipe", "email", "--token-count", "bpe", "--root", str(ROOT), "--preset", "ci"]) == 2
    assert "--token-count: expected words | tokenizer:" in capsys.readouterr().err
    assert main(["curate", "--input", str(mail), "--text-field", "body", "--out", str(tmp_path / "o2"),
                 "--recipe", "email", "--token-count", "tokenizer:missing.json", "--root", str(ROOT), "--preset", "ci"]) == 2
    assert "no tokenizer file at" in capsys.readouterr().err and not (tmp_path / "o2").exists()
    with pytest.raises(ConfigError, match=r"curation\.token_count: expected words \| tokenizer:"):
        from_mapping(CurationConfig, {"active": ["raw"], "variants": {"raw": {}}, "token_count": "bpe"},
                     prefix="curation")


def test_a_text_field_the_records_lack_is_refused_naming_file_line_and_key(tmp_path: Path, capsys):
    mail = write_mail(tmp_path / "mail.jsonl")
    out = tmp_path / "out"
    assert main(["curate", "--input", str(mail), "--out", str(out), "--recipe", "email", "--workers", "1",
                 "--root", str(ROOT), "--preset", "ci"]) == 2  # default text_field `text`
    err = capsys.readouterr().err
    assert f"{mail}: line 1: no 'text' key (text_field); this record's keys are ['body', 'meta']" in err
    assert not out.exists()


def test_without_input_curate_reads_the_sources_the_pipeline_prepares(tmp_path: Path):
    mail = write_mail(tmp_path / "mail.jsonl")
    shutil.copytree(ROOT / "params", tmp_path / "params")
    prepare = yaml.safe_load((tmp_path / "params" / "prepare.yaml").read_text())
    prepare["prepare"]["sources"] = [{"kind": "jsonl", "files": [str(mail)], "text_field": "body",
                                      "id_field": "meta.id", "name": "mail"}]
    (tmp_path / "params" / "prepare.yaml").write_text(yaml.safe_dump(prepare))
    out = tmp_path / "out"
    assert main(["curate", "--root", str(tmp_path), "--preset", "ci", "--out", str(out), "--recipe", "email",
                 "--workers", "1"]) == 0
    kept = pl.read_parquet(out / "kept.parquet")
    assert kept["id"].to_list() == ["a1", "a3"] and set(kept["source"]) == {"mail"}
