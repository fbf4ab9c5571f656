import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from harness import shutdown  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pool():
    yield
    shutdown()
