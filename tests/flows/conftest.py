from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def prefect_harness():
    """One temporary Prefect API for every flow test in the session (~15 s to start)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
