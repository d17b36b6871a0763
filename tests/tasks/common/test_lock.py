"""One workdir, one writer: a live holder is named and refused; a dead holder's lock is taken over."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.common.lock import LOCK_FILE, WorkdirBusy, workdir_lock

HOLD = """
import sys, time
from tasks.common.lock import workdir_lock
with workdir_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def _holder(workdir: Path, seconds: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(workdir), str(seconds)], stdout=subprocess.PIPE,
                            text=True, cwd=Path(__file__).resolve().parents[3])
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_writer_is_refused_naming_the_holder(tmp_path: Path):
    proc = _holder(tmp_path, 30)
    try:
        before = sorted(p.name for p in tmp_path.iterdir())
        with pytest.raises(WorkdirBusy, match=rf"workdir {tmp_path} is being written by pid {proc.pid} on .* \(since "):
            with workdir_lock(tmp_path):
                pass
        assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing touched
    finally:
        proc.kill()
        proc.wait()


def test_a_dead_holders_lock_is_taken_over_and_reported(tmp_path: Path):
    proc = _holder(tmp_path, 30)
    proc.kill()  # SIGKILL: the kernel drops the flock, the record stays
    proc.wait()
    with workdir_lock(tmp_path) as claim:
        assert claim.fresh and claim.previous["pid"] == proc.pid
        record = json.loads((tmp_path / LOCK_FILE).read_text())
        assert record["pid"] == os.getpid() and record["since"]
        with workdir_lock(tmp_path) as nested:  # re-entrant within a process
            assert not nested.fresh and nested.previous is None
    assert (tmp_path / LOCK_FILE).read_text() == ""  # a clean exit leaves nothing to take over
    with workdir_lock(tmp_path) as claim:
        assert claim.fresh and claim.previous is None


def test_the_lock_is_free_again_once_the_holder_exits(tmp_path: Path):
    proc = _holder(tmp_path, 0.1)
    proc.wait()
    time.sleep(0.05)
    with workdir_lock(tmp_path) as claim:
        assert claim.fresh
