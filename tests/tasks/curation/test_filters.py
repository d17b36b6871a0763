"""Heuristic filters: each rule on hand-made documents, fuzzing, and agreement with datatrove."""

from __future__ import annotations

import random

import numpy as np
import polars as pl
import pytest
import regex
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tasks.curation import filters as F
from tasks.curation.text import count_sentences, split_into_words

GOOD = (
    "The committee met on Tuesday to discuss the budget for the coming year. "
    "Members agreed that the school needs more teachers and with them better books.\n"
    "Several parents spoke about the long walk their children have to school each morning. "
    "The mayor promised to look into a new bus route before the winter.\n"
    "A vote on the final plan will be held next month, and the results will be published online.\n"
    "Everyone who attended said the discussion was useful and calm."
)


def reason(fn, text, **cfg):
    cls = next(c for c, f in F.FILTERS.values() if f is fn)
    return fn(pl.Series([text]), cls(**cfg)).reasons[0]


def test_good_document_passes_every_filter():
    for name, (cls, fn) in F.FILTERS.items():
        assert fn(pl.Series([GOOD]), cls()).reasons[0] is None, name


@pytest.mark.parametrize(
    "text, rule",
    [
        ("the cat and the dog " * 5, "word_count"),  # 25 words < 50
        ("the of and " + "aaaaaaaaaaaaaaaaaaaa " * 60, "avg_word_length"),
        ("the of and a b c " * 20, "avg_word_length"),  # mean length < 3
        (GOOD + " #tag" * 15, "hash_ratio"),
        (GOOD + " wait..." * 15, "ellipsis_ratio"),
        ("\n".join(["- the item and the thing number one"] * 20) + "\nlast line of the text", "bullet_lines"),
        ("\n".join(["the story goes on and on for a while..."] * 6 + ["the end of it all with the text"] * 8),
         "ellipsis_lines"),
        ("the and of to " + "12345 67890 1234 555 " * 30, "alpha_words"),
        ("Cats sit quietly near warm windows during cold winter afternoons. " * 8, "stop_words"),
    ],
    ids=["few_words", "long_words", "short_words", "hashes", "ellipses", "bullets", "end_ellipsis",
         "non_alpha", "no_stop_words"],
)
def test_gopher_quality_rules(text, rule):
    assert reason(F.gopher_quality, text) == f"gopher_quality.{rule}"


def test_gopher_quality_disabled_rule_passes():
    text = "the cat and the dog " * 5
    assert reason(F.gopher_quality, text, min_doc_words=None) is None


@pytest.mark.parametrize(
    "text, rule",
    [
        ("", "empty"),
        (("same paragraph here with the words.\n\n" * 5) + "other one.\n\nthird one.", "dup_para_frac"),
        ("\n".join(["identical line with the words and more."] * 5 + ["a", "b", "c", "d", "e", "f", "g"]),
         "dup_line_frac"),
        (" ".join(["the cat"] * 40) + " " + GOOD[:200], "top_2_gram"),
        (GOOD + " " + " ".join(GOOD.split()[:30]) + " " + " ".join(GOOD.split()[:30]), "dup_5_gram"),
    ],
    ids=["empty", "dup_paragraphs", "dup_lines", "top_bigram", "dup_5gram"],
)
def test_gopher_repetition_rules(text, rule):
    assert reason(F.gopher_repetition, text) == f"gopher_repetition.{rule}"


def test_gopher_repetition_greedy_skip_matches_reference():
    # the greedy duplicate count skips n words after each repeat; compare with a direct port
    rng = random.Random(0)
    vocab = ["alpha", "beta", "gamma", "delta", "the", "of"]
    for _ in range(30):
        words = [rng.choice(vocab) for _ in range(rng.randint(10, 80))]
        text = " ".join(words)
        for n in (5, 6):
            seen, rep, idx = set(), 0, 0
            while idx < len(words) - n + 1:
                g = "".join(words[idx: idx + n])
                if g in seen:
                    rep += len(g)
                    idx += n
                else:
                    seen.add(g)
                    idx += 1
            frac = rep / len(text)
            cfg = F.GopherRepetitionConfig(dup_line_frac=None, dup_para_frac=None, dup_line_char_frac=None,
                                           dup_para_char_frac=None, top_n_grams=(),
                                           dup_n_grams=((n, max(frac - 1e-9, 0.0)),))
            got = F.gopher_repetition(pl.Series([text]), cfg).reasons[0]
            assert (got == f"gopher_repetition.dup_{n}_gram") == (rep > 0), (text, n)


def test_c4_rules_and_line_removal():
    res = F.c4_quality(pl.Series([GOOD + "\nClick here\nWe use cookies on this site to help you.\n"
                                  "Enable JavaScript to see this page now."]))
    assert res.reasons[0] is None
    kept = res.texts[0]
    assert "Click here" not in kept and "cookies" not in kept and "JavaScript" not in kept
    assert kept.startswith("The committee met")
    assert reason(F.c4_quality, GOOD + "\nLorem ipsum dolor sit amet.") == "c4_quality.lorem_ipsum"
    assert reason(F.c4_quality, GOOD + "\nThe value is {x} here.") == "c4_quality.curly_bracket"
    assert reason(F.c4_quality, "One sentence only here. Two of them.") == "c4_quality.too_few_sentences"
    # citation markers are removed from kept lines
    res = F.c4_quality(pl.Series([GOOD + "\nThe river is long and wide.[1]"]))
    assert res.texts[0].endswith("The river is long and wide.")


def test_fineweb_rules():
    assert reason(F.fineweb_quality, "   \n\n") == "fineweb_quality.empty"
    assert reason(F.fineweb_quality, "\n".join(["no punctuation on this line at all friend"] * 10)) == \
        "fineweb_quality.line_punct_ratio"
    assert reason(F.fineweb_quality, "\n".join(["Short line."] * 10)) == "fineweb_quality.short_line_ratio"
    dup = GOOD + "\n" + GOOD.splitlines()[0]
    assert reason(F.fineweb_quality, dup) == "fineweb_quality.char_dup_ratio"
    lst = "\n".join(f"Antidisestablishmentarianism{i:03d}forever." for i in range(30))
    assert reason(F.fineweb_quality, lst) == "fineweb_quality.list_ratio"


def test_aesthetic_rules():
    assert reason(F.aesthetic, GOOD) is None
    assert reason(F.aesthetic, GOOD + " Lorem Ipsum dolor.") == "aesthetic.lorem_ipsum"
    assert reason(F.aesthetic, GOOD + " Call `foo()` first.") == "aesthetic.inline_code"
    assert reason(F.aesthetic, GOOD + " function (a) { return a; }") == "aesthetic.inline_code"
    assert reason(F.aesthetic, "$$$ %%% ### 12 !!! ??? ***") == "aesthetic.alphanumeric_ratio"
    assert reason(F.aesthetic, "") == "aesthetic.alphanumeric_ratio"


def test_tokenizer_matches_spacy_conventions():
    assert split_into_words("Don't stop -- it's well-known (U.S.).") == [
        "Do", "n't", "stop", "--", "it", "'s", "well", "-", "known", "(", "U.S.", ")", "."]
    assert split_into_words("$5.00, 1,000 x@y.com e.g. Mr. Smith 10km F-35 and/or") == [
        "$", "5.00", ",", "1,000", "x@y.com", "e.g.", "Mr.", "Smith", "10", "km", "F-35", "and", "/", "or"]
    assert count_sentences(split_into_words('He said "no." Then left!! Why? ok')) == 4
    assert count_sentences([]) == 0


def test_configs_validate():
    with pytest.raises(ValueError, match="max_doc_words"):
        F.GopherQualityConfig(min_doc_words=10, max_doc_words=5)
    with pytest.raises(ValueError, match="dup_line_frac"):
        F.GopherRepetitionConfig(dup_line_frac=1.5)
    with pytest.raises(ValueError, match="min_num_sentences"):
        F.C4QualityConfig(min_num_sentences=-3)
    with pytest.raises(ValueError, match="code_pattern"):
        F.AestheticConfig(code_pattern="(")
    with pytest.raises(TypeError):
        F.GopherQualityConfig(50)  # keyword-only


def test_null_texts_and_result_shape():
    s = pl.Series([None, GOOD, ""], dtype=pl.Utf8)
    for name, (cls, fn) in F.FILTERS.items():
        res = fn(s, cls())
        assert res.reasons.dtype == pl.Utf8 and len(res.reasons) == 3
        assert res.reasons[0] is not None, name  # a null document is empty and fails every filter
        assert res.keep.to_list()[1] is True


def _known(name: str, r: str | None) -> bool:
    if r is None:
        return True
    prefix, _, rule = r.partition(".")
    return prefix == name and rule in F.RULES[name]


junk = st.one_of(
    st.text(max_size=400),
    st.text(alphabet=st.characters(codec="utf-8"), max_size=200),
    st.binary(max_size=300).map(lambda b: b.decode("latin-1")),
    st.builds(lambda w, k: (w + " ") * k, st.text(min_size=1, max_size=12), st.integers(1, 400)),
    st.builds(lambda c, k: c * k, st.sampled_from(["a", "#", ".", "\n", "-", "…", "{", " "]),
              st.integers(0, 5000)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(junk, min_size=1, max_size=6))
def test_fuzz_no_crash_and_known_reasons(docs):
    s = pl.Series(docs, dtype=pl.Utf8)
    for name, (cls, fn) in F.FILTERS.items():
        res = fn(s, cls())
        assert len(res.reasons) == len(docs)
        assert all(_known(name, r) for r in res.reasons.to_list()), (name, res.reasons.to_list())
    # every non-whitespace character (Unicode \s, as the tokenizer's regex sees it) is in one token
    for d in docs:
        assert "".join(split_into_words(d)) == regex.sub(r"\s", "", d)


def test_huge_single_line_document():
    doc = "word " * 200_000 + "x" * 5000
    for name, (cls, fn) in F.FILTERS.items():
        r = fn(pl.Series([doc]), cls()).reasons[0]
        assert _known(name, r)
    assert F.gopher_quality(pl.Series([doc])).reasons[0] == "gopher_quality.word_count"


# --------------------------------------------------------------------------- datatrove agreement

SAMPLE = [
    GOOD,
    GOOD + "\n" + GOOD.splitlines()[1],
    "the cat and the dog " * 5,
    "\n".join(["- the item and the thing number one"] * 20),
    " ".join(["the cat"] * 40) + " " + GOOD[:200],
    GOOD + " Lorem ipsum dolor sit amet.",
    GOOD.replace(".", "") ,
    "Breaking: the market fell 3.5% on Tuesday, and it's not clear why... Analysts (e.g. Mr. Smith of "
    "the U.S. bank) said they'd expected a well-known pattern to hold. " * 6,
]


def _random_docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = GOOD.replace("\n", " ").split() + ["#x", "...", "-", "•", "1990s", "don't", "U.S.", "{", "[1]"]
    out = []
    for _ in range(n):
        lines = []
        for _ in range(rng.randint(1, 12)):
            lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(1, 25))) + rng.choice([".", "", "!", "..."]))
        out.append(("\n" * rng.randint(1, 2)).join(lines))
    return out


def test_agreement_with_datatrove():
    pytest.importorskip("spacy", reason="datatrove's English tokenizer needs spacy (pip install scalelab[bench] spacy)")
    dt_filters = pytest.importorskip("datatrove.pipeline.filters", reason="datatrove is a benchmark extra")
    from datatrove.data import Document

    docs = SAMPLE + _random_docs(300)
    pairs = [
        (dt_filters.GopherQualityFilter(), F.gopher_quality),
        (dt_filters.GopherRepetitionFilter(), F.gopher_repetition),
        (dt_filters.C4QualityFilter(), F.c4_quality),
        (dt_filters.FineWebQualityFilter(), F.fineweb_quality),
    ]
    for dt, fn in pairs:
        theirs = []
        for i, d in enumerate(docs):
            r = dt.filter(Document(text=d, id=str(i)))
            theirs.append(r is True)
        ours = fn(pl.Series(docs)).reasons.is_null().to_list()
        agree = np.mean(np.array(ours) == np.array(theirs))
        assert agree >= 0.97, (fn.__name__, agree)
        assert 0 < sum(theirs) < len(docs)  # the sample exercises both outcomes


def test_punctuation_tables_match_datatrove():
    text_mod = pytest.importorskip("datatrove.utils.text", reason="datatrove is a benchmark extra")
    from tasks.curation import text as T

    assert set(T.PUNCTUATION) == set(text_mod.PUNCTUATION)
    assert T.TERMINAL_PUNCTUATION == frozenset(text_mod.TERMINAL_PUNCTUATION)
