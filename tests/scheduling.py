"""How `make test` shares the tests out over pytest-xdist workers (Makefile TEST_WORKERS).

One file's tests stay on one worker (xdist's ``loadfile``), so a module's fixtures are built once, and
the files that use the session's ``ci`` pipeline (the ``ci_run`` fixture, tests/flows/conftest.py) form
one unit, so that pipeline runs once. (xdist's ``loadgroup`` marks would say this per test, but with
pytest 9 the marks never reach the scheduler.)"""

from __future__ import annotations

CI_RUN_FILES = (
    "tests/flows/test_crash_resume.py",
    "tests/flows/test_pipeline_ci.py",
    "tests/flows/test_validate.py",
)


def scope(nodeid: str) -> str:
    """The unit a test is scheduled with: its file, or ``ci_run`` for every file in CI_RUN_FILES."""
    path = nodeid.split("::", 1)[0]
    return "ci_run" if path in CI_RUN_FILES else path


def make_scheduler(config, log):
    from xdist.scheduler import LoadFileScheduling

    class OneCiPipeline(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope(nodeid)

    return OneCiPipeline(config, log)
