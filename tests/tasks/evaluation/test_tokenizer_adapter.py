"""The tokenizer adapter: the vocabulary check names both sides."""

from __future__ import annotations

import pytest

from tasks.lm.tokenizer import check_vocabulary
from tests.tasks.evaluation.olmo_support import needs_olmo_eval

pytestmark = needs_olmo_eval


def test_vocabulary_mismatch_is_named(neox):
    with pytest.raises(ValueError, match="vocabulary mismatch: neox has 50280 tokens but the model's embedding has 512"):
        check_vocabulary(neox, 512, model="tiny", tokenizer_name="neox")
    check_vocabulary(neox, 50304, model="tiny", tokenizer_name="neox")  # a larger embedding is fine
