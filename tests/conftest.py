"""Test session setup: offline Flower settings for every test (helpers live in ``helpers.py``), and which tests
share one pytest-xdist worker.

The suite runs on two workers (``addopts`` in pyproject.toml). The tests that start Flower's or Ray's services,
launch sweeps or time benchmarks, or send signals to a run are kept on one worker, one after the other (their
``xdist_group``): each still has a neighbour on the other core, never another of its kind, and test_deploy's
federation (a module fixture) is started once.
"""

import re

import pytest

from fedsim.config import flower_env

flower_env()

SERVICES_FILES = ("test_deploy.py", "test_sweepers.py", "test_bench_smoke.py", "test_ray_cluster.py")
SERVICES_NAMES = re.compile(r"ray|sigterm|sigkill|signal|ctrl_c|interrupt")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SERVICES_FILES or SERVICES_NAMES.search(item.name):
            item.add_marker(pytest.mark.xdist_group("services"))
