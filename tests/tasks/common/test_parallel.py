import os

from tasks.common.parallel import map_processes


def _pid_and_power(x: int, p: int) -> tuple[int, int]:
    return os.getpid(), x**p


def test_results_keep_the_jobs_order_and_run_in_other_processes():
    jobs = {k: (k, 2) for k in (5, 1, 4, 2, 3)}
    out = map_processes(_pid_and_power, jobs, 2)
    assert list(out) == [5, 1, 4, 2, 3] and [v for _, v in out.values()] == [25, 1, 16, 4, 9]
    assert os.getpid() not in {pid for pid, _ in out.values()}


def test_one_worker_or_one_job_runs_here():
    assert {pid for pid, _ in map_processes(_pid_and_power, {"a": (2, 3), "b": (3, 2)}, 1).values()} == {os.getpid()}
    assert map_processes(_pid_and_power, {"a": (2, 3)}, 4) == {"a": (os.getpid(), 8)}
    assert map_processes(_pid_and_power, {}, 2) == {}
