"""The product's tests, by area (api, kernels, hf, training, packaging); support/ holds the float64 oracles, worker
scripts and helpers they import. Fixtures for every area: ``rng`` (fresh, reproducible inputs) and ``fresh_state``
(accelerate's process-wide state reset around a test)."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "support"))  # oracles, workers and helpers


SEED_ENV = "VOLTA_TRAIN_TEST_SEED"


@pytest.fixture
def rng(request):
    """A seeded generator per test, fresh inputs each run: the seed is random unless VOLTA_TRAIN_TEST_SEED gives it,
    and is printed (pytest shows it with a failure), so ``VOLTA_TRAIN_TEST_SEED=<seed> pytest <test>`` reproduces it."""
    seed = int(os.environ.get(SEED_ENV) or int.from_bytes(os.urandom(4), "little"))
    print(f"{request.node.nodeid}: rng seed {seed} ({SEED_ENV}={seed} reproduces it)")
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def fresh_state():
    """accelerate's process-wide state (AcceleratorState, PartialState) reset before and after the test, so that an
    in-process recipe run or Accelerator starts as in a new process and leaves nothing to the next test."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)
