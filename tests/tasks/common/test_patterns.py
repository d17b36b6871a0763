"""tasks.common.patterns: a name matches a list of shell patterns."""

from __future__ import annotations

import pytest

from tasks.common.patterns import matches_any


@pytest.mark.parametrize(
    ("name", "patterns", "expected"),
    [
        ("model.layers.3.mlp.down_proj", ("*.mlp.*",), True),
        ("model.layers.3.self_attn.q_proj", ("*.mlp.*", "*.self_attn.[qk]_proj"), True),
        ("model.layers.3.self_attn.v_proj", ("*.mlp.*", "*.self_attn.[qk]_proj"), False),
        ("lm_head", (), False),
        ("LM_HEAD", ("lm_head",), False),  # case-sensitive on every platform
        ("anybcq_g128@w3", iter(["gptq*", "anybcq_*@w3"]), True),  # any iterable, read once
    ],
    ids=["glob", "second-pattern", "no-match", "no-patterns", "case", "iterator"],
)
def test_matches_any(name, patterns, expected):
    assert matches_any(name, patterns) is expected
