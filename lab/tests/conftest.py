"""The lab's tests import their instruments from lab/ and the float64 oracles from tests/."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT / "lab"), str(ROOT / "tests" / "support")]


def pytest_addoption(parser):
    parser.addoption("--v100model", action="store_true",
                     help="also run the lab tests that need the V100 pipe model (shared/tools/v100model, outside "
                          "this repository)")


def pytest_configure(config):
    config.addinivalue_line("markers", "v100model: needs shared/tools/v100model/sass_cost.py (run with --v100model)")


def pytest_collection_modifyitems(config, items):
    """Tests that need the pipe model run only when asked for: the repository's own suite needs nothing outside it
    (gpu-marked tests skip without a GPU by the repository's conftest.py)."""
    if config.getoption("--v100model"):
        return
    kept = [item for item in items if "v100model" not in item.keywords]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if "v100model" in item.keywords])
        items[:] = kept
