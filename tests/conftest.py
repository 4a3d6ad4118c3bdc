"""Pytest wiring: --impl picks the code under test; the `gpu` marker skips off-Hopper; module copies for tests."""

import importlib.util
import sys

import pytest

from course.runtime import stages
from course import testing
from course.tools import skeleton


def pytest_addoption(parser):
    parser.addoption(
        "--impl", choices=stages.IMPLS, default="solutions",
        help="test the reference solutions (default) or the learner's code in stages/",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a Hopper GPU (sm_90) and the CuTe DSL")
    config.addinivalue_line("markers", "compiles: compiles a kernel or a CPU host function (seconds each); "
                                       "`course check` prints a progress line for each")


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


@pytest.fixture
def module_from_source(tmp_path):
    """Import source text as a module of its own (a file in tmp_path: the DSL reads kernels' source from files)."""
    def load(name: str, source: str, package: str = "solutions"):
        path = tmp_path / f"{name}.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        module.__package__ = package  # where its relative imports look (stage 8 imports stage 6's merge)
        sys.modules[name] = module  # dataclasses look their module up while the class is made
        spec.loader.exec_module(module)
        return module
    return load


@pytest.fixture
def generated_skeleton(module_from_source):
    """A stage's skeleton as the generator makes it: what a learner starts from, whatever stages/ holds now."""
    def load(stage: stages.Stage):
        return module_from_source(f"generated_{stage.module_name}", skeleton.expected_skeleton(stage), "stages")
    return load
