"""Pytest wiring: --impl picks the code under test; the `gpu` marker skips off-Hopper."""

import pytest

from course import stages, testing


def pytest_addoption(parser):
    parser.addoption(
        "--impl", choices=stages.IMPLS, default="solutions",
        help="test the reference solutions (default) or the learner's code in stages/",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a Hopper GPU (sm_90) and the CuTe DSL")


def pytest_collection_modifyitems(config, items):
    reason = testing.gpu_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def impl(request) -> str:
    return request.config.getoption("--impl")
