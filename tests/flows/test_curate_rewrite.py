"""``scalelab curate`` with a rewrite recipe: the rewriter is built from the recipe file (or flags),
a budgeted rewrite resumes on rerun, and a new generator does not reuse old rewrites. No network:
fake generators, and for the CLI an OpenAI-compatible server on 127.0.0.1."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import polars as pl
import pytest

from flows.cli import main
from flows.curate import curate_any
from tasks.common.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
WORDS = "the river runs past old stone walls where children play each summer evening".split()


class Echo:
    """Answers 'Rewritten: <document>' and counts the documents it was asked for."""

    def __init__(self):
        self.asked: list[str] = []

    def generate(self, conversations):
        docs = [c[-1]["content"].rsplit("\n\n", 1)[-1] for c in conversations]
        self.asked += docs
        return [f"Rewritten clearly: {d}" for d in docs]


def _corpus(tmp_path: Path, n: int = 5) -> Path:
    path = tmp_path / "docs.jsonl"
    with path.open("w") as fh:
        for i in range(n):
            fh.write(json.dumps({"id": f"d{i}", "text": f"document {i}: " + " ".join(WORDS[i:] + WORDS[:i])}) + "\n")
    return path


def _recipe(tmp_path: Path, rewrite: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text("curation:\n  shard_docs: 2\n" + rewrite + "  variants:\n    rw:\n"
                    "      steps: [{exact_dedup: {}}, {rewrite: {style: hq, budget: null}}, {mix: {rewritten: 1.0}}]\n")
    return path


def test_budgeted_rewrite_resumes_until_done(tmp_path):
    corpus = _corpus(tmp_path)
    recipe = _recipe(tmp_path, "  rewrite: {model_dir: /models/fake, max_docs_per_run: 2, min_words: 3}\n")
    out = tmp_path / "out"
    pending, rewritten, asked = [], [], []
    for _ in range(4):
        gen = Echo()
        stats = curate_any(inputs=[corpus], out=out, recipe="rw", recipe_file=recipe, root=ROOT, workers=1,
                           generator=gen)
        pending.append(stats["run"]["rewrite_pending"])
        rewritten.append(stats["docs_rewritten"])
        asked.append(len(gen.asked))
    assert asked == [2, 2, 1, 0]  # two new generations a run, none once every document is done
    assert pending == [3, 1, 0, 0] and rewritten == [2, 4, 5, 5]
    assert stats["run"]["shards_computed"] == 0  # done: the fourth run reuses every part
    kept = pl.read_parquet(out / "kept.parquet")
    assert kept["text"].str.starts_with("Rewritten clearly: ").all() and kept.height == 5
    cache = pl.read_parquet(out / "rewrite_cache" / "rewrites.parquet")
    assert cache["generator"].n_unique() == 1 and cache["finish_reason"].null_count() == 5  # Echo gives none


def test_new_model_flag_regenerates(tmp_path):
    corpus = _corpus(tmp_path, 3)
    recipe = _recipe(tmp_path, "  rewrite: {model_dir: /models/fake, min_words: 3}\n")
    out = tmp_path / "out"
    first = Echo()
    curate_any(inputs=[corpus], out=out, recipe="rw", recipe_file=recipe, root=ROOT, workers=1, generator=first)
    assert len(first.asked) == 3
    again = Echo()
    curate_any(inputs=[corpus], out=out, recipe="rw", recipe_file=recipe, root=ROOT, workers=1, generator=again)
    assert again.asked == []  # same generator settings: nothing to do
    other = Echo()
    stats = curate_any(inputs=[corpus], out=out, recipe="rw", recipe_file=recipe, root=ROOT, workers=1,
                       generator=other, rewrite={"model_dir": "/models/other"})
    assert len(other.asked) == 3 and stats["run"]["rewrite_pending"] == 0


def test_bad_rewrite_override_names_the_section(tmp_path):
    corpus = _corpus(tmp_path, 2)
    recipe = _recipe(tmp_path, "")
    with pytest.raises(ConfigError, match=r"recipe.yaml: curation.rewrite: .*base_url"):
        curate_any(inputs=[corpus], out=tmp_path / "out", recipe="rw", recipe_file=recipe, root=ROOT,
                   rewrite={"kind": "openai"})
    assert not (tmp_path / "out").exists()


class _Chat(BaseHTTPRequestHandler):
    models: list[str] = []

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).models.append(body["model"])
        doc = body["messages"][-1]["content"].rsplit("\n\n", 1)[-1]
        data = json.dumps({"choices": [{"message": {"content": f"A clean rewrite of {doc}"},
                                        "finish_reason": "stop"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_cli_rewrite_recipe_against_a_local_openai_server(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Chat)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        corpus = _corpus(tmp_path, 3)
        out = tmp_path / "out"
        rc = main(["curate", "--input", str(corpus), "--out", str(out), "--recipe", "rewrite_hq_mix67",
                   "--rewrite-kind", "openai", "--base-url", f"http://127.0.0.1:{server.server_address[1]}",
                   "--model", "served-model", "--workers", "1", "--root", str(ROOT), "--preset", "ci"])
    finally:
        server.shutdown()
        server.server_close()
    assert rc == 0
    assert set(_Chat.models) == {"served-model"}
    stats = json.loads((out / "stats.json").read_text())
    assert stats["docs_rewritten"] > 0
    cache = pl.read_parquet(out / "rewrite_cache" / "rewrites.parquet")
    assert cache["rewritten"].all() and set(cache["finish_reason"]) == {"stop"}
