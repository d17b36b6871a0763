"""tasks.common.faults: a named point fires once, at the n-th call that matches its name and place."""

from __future__ import annotations

import signal

import pytest

import tasks.common.faults as faults


@pytest.fixture
def kills(monkeypatch):
    seen = []
    monkeypatch.setattr(faults.os, "killpg", lambda pgid, sig: seen.append(sig))
    monkeypatch.setattr(faults, "_SEEN", faults.Counter())
    return seen


def test_no_spec_is_a_no_op(monkeypatch, kills):
    monkeypatch.delenv("SCALELAB_FAULT", raising=False)
    faults.fault_point("atomic_dir.swap", "compressed")
    assert kills == []


def test_the_nth_matching_call_kills(monkeypatch, kills):
    monkeypatch.setenv("SCALELAB_FAULT", "train.checkpoint@2")
    faults.fault_point("train.checkpoint")
    assert kills == []
    faults.fault_point("atomic_dir.swap")
    faults.fault_point("train.checkpoint")
    assert kills == [signal.SIGKILL]
    faults.fault_point("train.checkpoint")
    assert kills == [signal.SIGKILL]  # once


def test_a_place_counts_only_its_own_calls(monkeypatch, kills):
    monkeypatch.setenv("SCALELAB_FAULT", "atomic_dir.swap:compressed")
    faults.fault_point("atomic_dir.swap", "prepared")
    faults.fault_point("atomic_dir.swap", "curated")
    assert kills == []
    faults.fault_point("atomic_dir.swap", "compressed")
    assert kills == [signal.SIGKILL]
