"""Hand-made pass/fail cases for tasks/curation/crawl.py and its steps inside recipes."""

from __future__ import annotations

import polars as pl
import pytest

from tasks.curation.crawl import (
    BpeTokenCount,
    LanguageIdConfig,
    PiiConfig,
    UrlFilterConfig,
    language_id,
    pii_normalize,
    token_counter,
    url_filter,
)
from tasks.curation.recipes import Recipe, run_recipe, step
from tasks.curation.text import whitespace_words

EN = "The committee met on Tuesday to discuss the budget for the new library and the school."
DE = "Der Ausschuss hat sich am Dienstag getroffen, um den Haushalt der neuen Bibliothek zu besprechen."
FR = "Le comité s'est réuni mardi pour discuter du budget de la nouvelle bibliothèque et de l'école."


def frame(texts, urls=None):
    data = {"id": [str(i) for i in range(len(texts))], "text": texts}
    if urls is not None:
        data["url"] = urls
    return pl.DataFrame(data)


def test_language_id_keeps_configured_languages():
    res = language_id(frame([EN, DE, FR]), LanguageIdConfig(languages=("en", "fr")))
    assert res.reasons.to_list() == [None, "language_id.other_language", None]
    assert res.stats["language_id.de"] == 1 and res.stats["language_id.en"] == 1


def test_language_id_threshold_drops_uncertain_text():
    res = language_id(frame([EN, "ok ok"]), LanguageIdConfig(languages=("en",), min_score=0.99))
    assert res.reasons[0] is None
    assert res.reasons[1] in ("language_id.low_score", "language_id.other_language")
    strict = language_id(frame([EN]), LanguageIdConfig(languages=("en",), min_score=1.0))
    assert strict.reasons.to_list() == ["language_id.low_score"]


def test_language_id_config_names_unknown_language():
    with pytest.raises(ValueError, match="languages"):
        LanguageIdConfig(languages=("xx",))


@pytest.mark.parametrize(("text", "expected", "kind"), [
    ("write to jane.doe+news@mail.example.org today", "write to <EMAIL_ADDRESS> today", "pii.email"),
    ("server at 8.8.4.4, port 53", "server at <IP_ADDRESS>, port 53", "pii.ip"),
    ("v6 2001:4860:4860::8888 here", "v6 <IP_ADDRESS> here", "pii.ip"),
    ("call (555) 123-4567 now", "call <PHONE_NUMBER> now", "pii.phone"),
    ("call +44 20 7946 0958 now", "call <PHONE_NUMBER> now", "pii.phone"),
    ("call 555-123-4567.", "call <PHONE_NUMBER>.", "pii.phone"),
])
def test_pii_replaces_each_kind(text, expected, kind):
    res = pii_normalize(frame([text]))
    assert res.texts.to_list() == [expected]
    assert res.stats[kind] == 1 and sum(res.stats.values()) == 1
    assert res.reasons.to_list() == [None]


@pytest.mark.parametrize("text", [
    "In 1999 the population was 1234567 and version 1.2.3 shipped.",  # years, counts, versions
    "the router is 192.168.0.1 and localhost 127.0.0.1",  # private addresses kept by default
    "not an address 999.1.1.1 nor a ratio 3:4, time 12:30",
    "email me at name at example dot com",
])
def test_pii_leaves_non_pii_alone(text):
    res = pii_normalize(frame([text]))
    assert res.texts.to_list() == [text]
    assert sum(res.stats.values()) == 0


def test_pii_private_ips_replaced_when_asked_and_kinds_disabled():
    res = pii_normalize(frame(["at 192.168.0.1 or a@b.io"]), PiiConfig(keep_private_ips=False, email=None))
    assert res.texts.to_list() == ["at <IP_ADDRESS> or a@b.io"]


def test_url_filter_domains_words_and_missing_urls(tmp_path):
    block = tmp_path / "block.txt"
    block.write_text("# crawl block list\ndomain spam.example\nword casino\n")
    cfg = UrlFilterConfig(blocklist_file=str(block), domains=("ads.test",))
    urls = ["https://www.spam.example/page", "http://best-casino.net/x", "https://casinos.org/a",
            "https://news.example/story", None, "https://x.ads.test/", "https://notspam.example/"]
    res = url_filter(frame(["t"] * len(urls), urls), cfg)
    assert res.reasons.to_list() == ["url_filter.blocked_domain", "url_filter.blocked_word", None, None, None,
                                     "url_filter.blocked_domain", None]
    assert res.stats["url_filter.no_url"] == 1 and "url_filter.no_url_column" not in res.stats
    absent = url_filter(frame(["t", "u"]), cfg)
    assert absent.reasons.to_list() == [None, None] and absent.stats["url_filter.no_url_column"] == 1


def test_url_blocklist_bad_line_names_file_and_line(tmp_path):
    block = tmp_path / "block.txt"
    block.write_text("domain ok.example\nhost bad.example\n")
    with pytest.raises(ValueError, match=r"block.txt:2"):
        UrlFilterConfig(blocklist_file=str(block))
    with pytest.raises(ValueError, match="blocklist_file"):
        UrlFilterConfig(blocklist_file=str(tmp_path / "missing.txt"))


def test_crawl_steps_in_a_recipe_report_reasons_and_counts():
    docs = frame([EN + " Mail bob@example.com.", DE, EN, EN + " Again."],
                 ["https://a.example/1", "https://b.example/2", "https://spam.example/3", None])
    recipe = Recipe(steps=(step("url_filter", domains=("spam.example",)), step("language_id", languages=("en",)),
                           step("pii")))
    res = run_recipe(docs, recipe)
    assert res.kept["id"].to_list() == ["0", "3"]
    assert "<EMAIL_ADDRESS>" in res.kept["text"][0]
    assert res.stats["dropped_by_reason"] == {"language_id.other_language": 1, "url_filter.blocked_domain": 1}
    assert res.stats["steps"][2]["pii.email"] == 1
    # the dropped frame holds the original text
    assert res.dropped.filter(pl.col("id") == "1")["text"].to_list() == [DE]


def test_bpe_token_count(tmp_path):
    from tasks.training.tokenizer import train_tokenizer

    tok = train_tokenizer([EN, DE, FR] * 20, vocab_size=300)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    count = token_counter("tokenizer:tokenizer.json", tmp_path)  # relative to the root given
    assert isinstance(count, BpeTokenCount) and count.name == f"tokenizer:{path}"
    texts = pl.Series([EN, "", None])
    got = count(texts).to_list()
    assert got[0] == len(tok.encode(EN, add_special_tokens=False).ids) and got[1:] == [0, 0]
    assert got[0] != whitespace_words(texts)[0]  # a real BPE count, not words
    assert token_counter("words") is whitespace_words
    with pytest.raises(FileNotFoundError, match=f"no tokenizer file at {tmp_path / 'absent.json'}"):
        token_counter("tokenizer:absent.json", tmp_path)
    with pytest.raises(ValueError, match=r"expected words \| tokenizer:"):
        token_counter("sentencepiece")


def test_full_preset_crawl_clean_recipe_uses_every_crawl_filter():
    from pathlib import Path

    from tasks.common.params import load_stage_config
    from tasks.curation.recipes import CurationConfig

    cfg = load_stage_config(CurationConfig, Path(__file__).resolve().parents[3], "curation", "full")
    recipe = cfg.recipe("crawl_clean")
    assert "crawl_clean" in cfg.active
    assert {"url_filter", "language_id", "pii"} <= {s.kind for s in recipe.steps}
    body = " ".join([EN] * 8)
    docs = frame([body + " Reach me at ann@site.example.", body.replace("budget", "casino night"), DE * 6,
                  body + " Call (555) 123-4567."],
                 ["https://city.example/a", "https://ads.doubleclick.net/b", "https://city.example/c", None])
    res = run_recipe(docs, recipe)
    reasons = dict(zip(res.dropped["id"], res.dropped["reason"]))
    assert reasons["1"] == "url_filter.blocked_domain" and reasons["2"] == "language_id.other_language"
    pii = next(s for s in res.stats["steps"] if s["step"] == "pii")
    assert pii["pii.email"] == 1 and pii["pii.phone"] == 1
