import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from harness import shutdown  # noqa: E402
from lanes import HALVES, LANES, in_half, in_lane  # noqa: E402

from startrail_megatron.bench.extensions import extensions_dir, remove_stale_locks  # noqa: E402

# Any op DeepSpeed builds goes into a folder of the suite's own, one per Python and torch
# release, kept between runs (a fresh clone reuses it), a killed build's lock removed (it
# would hang every later build there). Its CPU collectives op (~35 s on 2 cores) is not
# built in tests/harness.py's ranks unless STARTRAIL_TEST_DS_SHM=1; ranks a test starts
# by other means (the benchmark's) may build it.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir(os.environ, "tests"))
remove_stale_locks(os.environ["TORCH_EXTENSIONS_DIR"])

# A skipped test is a test that proved nothing: an import failure of megatron-core, DeepSpeed or
# transformers must fail the run, not turn it green. STARTRAIL_ALLOW_SKIPS=1 permits skips (a
# machine without the pinned extras, on purpose).
_ALLOW_SKIPS = os.environ.get("STARTRAIL_ALLOW_SKIPS") == "1"
_skipped: list[str] = []


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pool():
    yield
    shutdown()


_not_in_this_megatron: list[str] = []


def pytest_addoption(parser):
    parser.addoption(
        "--lane",
        default="all",
        choices=LANES,
        help="all: every test; stack: the test files of the code that imports megatron-core, "
        "DeepSpeed or transformers; ci-1, ci-2: CI's two lanes (tests/lanes.py)",
    )
    parser.addoption(
        "--half",
        default=0,
        type=int,
        choices=HALVES,
        help="1 or 2: that half of the lane's test files (tests/lanes.py SECOND_HALF_FILES; "
        "scripts/run_tests.sh runs both side by side); 0: all of them",
    )


def pytest_collection_modifyitems(config, items):
    """``--lane`` and ``--half`` keep their test files (``lanes.py``); then the tests of a newer
    megatron-core than the installed one are deselected (each test lane has its own:
    Python 3.11 with 0.16, 3.12 with 0.19) and the summary counts them."""
    lane, half = config.getoption("--lane"), config.getoption("--half")
    if lane != "all" or half:
        other = [
            i for i in items
            if not (in_lane(os.path.basename(str(i.path)), lane)
                    and in_half(os.path.basename(str(i.path)), half))
        ]  # fmt: skip
        if other:
            items[:] = [i for i in items if i not in set(other)]
            config.hook.pytest_deselected(items=other)
    marked = [i for i in items if i.get_closest_marker("megatron_min")]
    if not marked:
        return
    from startrail_megatron.megatron.versions import megatron_version

    have = megatron_version()
    drop = [i for i in marked if have < tuple(i.get_closest_marker("megatron_min").args)]
    if drop:
        _not_in_this_megatron.extend(i.nodeid for i in drop)
        items[:] = [i for i in items if i not in drop]
        config.hook.pytest_deselected(items=drop)


def pytest_collection_finish(session):
    """Once the test modules are imported and before any rank is forked: the suite's smaller
    ``--mock-data`` dataset (``megatron_common.shrink_mock_data``), so that every rank and every
    in-process reference of this session builds the same data."""
    if "megatron.core" in sys.modules:
        from megatron_common import shrink_mock_data

        shrink_mock_data()


def pytest_runtest_logreport(report):
    if report.skipped:
        _skipped.append(report.nodeid)


def pytest_collectreport(report):
    if report.skipped:
        _skipped.append(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    if _skipped and not _ALLOW_SKIPS and exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter):
    if _not_in_this_megatron:
        from startrail_megatron.megatron.versions import megatron_version

        terminalreporter.write_line(
            f"{len(_not_in_this_megatron)} test(s) need a newer megatron-core than the installed "
            f"{'.'.join(map(str, megatron_version()))} (run on the Python 3.12 lane): "
            + ", ".join(_not_in_this_megatron)
        )
    if _skipped and not _ALLOW_SKIPS:
        terminalreporter.write_line(
            f"FAILED: {len(_skipped)} test(s) skipped (set STARTRAIL_ALLOW_SKIPS=1 to permit): "
            + ", ".join(_skipped[:10]),
            red=True,
        )
