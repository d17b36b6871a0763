"""Session fixtures of the downstream-evaluation tests (see olmo_support.py)."""

from __future__ import annotations

import pytest

from tests.tasks.evaluation.olmo_support import neox_model, neox_tokenizer


@pytest.fixture(scope="session")
def neox():
    return neox_tokenizer()


@pytest.fixture(scope="session")
def model(neox):
    return neox_model()
