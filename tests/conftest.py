"""Test session setup: offline Flower settings for every test (helpers live in ``helpers.py``), and which tests
run on one pytest-xdist worker in turn.

The suite runs on two workers (``addopts`` in pyproject.toml). The tests that start Flower's or Ray's services,
launch sweeps, run a CPU-burning neighbour, or send signals to a run are kept on one worker, one after the
other (one scope of the scheduler): each still has a neighbour on the other core, never another of its kind,
and test_deploy's federation (a module fixture) is started once. That worker's chain sets the suite's wall
time, so tests that need none of this (the benchmark smoke tests among them) stay off it.
"""

import re
import signal

import pytest

from fedsim.config import flower_env

flower_env()

# A shell starts a background job (`pytest &`, `nohup pytest`) with SIGINT (and under nohup SIGHUP) ignored, and
# a process started with a signal ignored keeps it ignored: fedsim then rightly leaves it alone (a user's nohup
# wins), and the tests that signal a run (tests/test_reliability.py) would see nothing. The suite restores the
# default dispositions for itself and every process it starts.
for _sig, _default in (
    (signal.SIGINT, signal.default_int_handler),
    (signal.SIGTERM, signal.SIG_DFL),
    (signal.SIGHUP, signal.SIG_DFL),
):
    if signal.getsignal(_sig) == signal.SIG_IGN:
        signal.signal(_sig, _default)

SERVICES_FILES = (
    "test_deploy.py",
    "test_sweepers.py",
    "test_ray_cluster.py",
    "test_netns.py",
    "test_netns_churn.py",
    "test_netns_ray.py",
)
# "ray" as a word of the test name (not in "arrays"); "busy": a test that runs a CPU-burning neighbour. The
# other benchmark smoke tests assert no timing and share the second worker with the rest.
SERVICES_NAMES = re.compile(
    r"(?:^|[_=\[-])ray(?:[_\]-]|$)|simulation|sigterm|sigkill|signal|ctrl_c|interrupt|busy"
)


def services(nodeid: str) -> bool:
    """A test that starts services, launches sweeps, times a benchmark or signals a run (by file or name)."""
    path, _, name = nodeid.partition("::")
    return path.rsplit("/", 1)[-1] in SERVICES_FILES or bool(SERVICES_NAMES.search(name))


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scheduling by scope, with one scope for the services tests (in collection order, so a
    module's fixtures are set up once) and one per test for the rest. (``--dist loadgroup`` would do this from
    markers, but pytest-xdist 3.8 marks a group in ``item._nodeid``, which pytest 9 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class Services(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "services" if services(nodeid) else nodeid

    return Services(config, log)


@pytest.fixture(autouse=True)
def _pictures_only_where_asked(request, monkeypatch):
    """A run in the test's process draws no pictures unless the test is marked ``pictures``: the drawing process
    (fedsim.figures.FigureWorker, one a process) takes about 1.3 s of CPU to start, a tiny run about 0.15 s. Runs
    started as commands (``fedsim ...`` in a subprocess) draw theirs as always."""
    if request.node.get_closest_marker("pictures") is None:
        from helpers import NoPictures

        import fedsim.run

        monkeypatch.setattr(fedsim.run, "start_figures", NoPictures)
