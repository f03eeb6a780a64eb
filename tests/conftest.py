import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_modifyitems(config, items):
    has_gpu = torch.cuda.is_available()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)


@pytest.fixture
def rng():
    """A fresh, unseeded generator per test: inputs differ run to run (the seed is printed on failure)."""
    seed = int.from_bytes(os.urandom(4), "little")
    return torch.Generator().manual_seed(seed)  # rng.initial_seed() reproduces a failure
