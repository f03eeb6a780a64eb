"""Test-suite wide (tests/ and lab/tests/): one kernel cache per run, the cores shared among pytest-xdist workers,
gpu-marked tests skipped without a CUDA GPU, and the tests marked launches_processes (or compiles_kernels) kept
on one pytest-xdist worker."""

import os
import shutil
import tempfile

import pytest
import torch

# The kernel cache of a test run: one temporary directory shared by every test and worker process of the run (so each
# kernel compiles once), removed at the end; never the user's ~/.cache/volta_train/kernels. A VOLTA_TRAIN_CACHE_DIR
# set before pytest starts is used instead (and kept), e.g. to reuse compiled kernels across runs.
CACHE_DIR_ENV = "VOLTA_TRAIN_CACHE_DIR"
_RUN_CACHE = "VOLTA_TRAIN_TEST_RUN_CACHE"  # set when this run made the directory (pytest-xdist workers inherit it)


def _available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pytest_configure(config):
    if hasattr(config, "workerinput"):
        # pytest-xdist workers share the cores: unless the user set OMP_NUM_THREADS, each worker's torch threads and
        # (through it) its child processes' get cores / workers, so two workers never run 2x the threads on 2 cores.
        if "OMP_NUM_THREADS" not in os.environ:
            threads = max(1, _available_cores() // int(config.workerinput.get("workercount", 1)))
            os.environ["OMP_NUM_THREADS"] = str(threads)
            torch.set_num_threads(threads)
    if hasattr(config, "workerinput") or os.environ.get(CACHE_DIR_ENV):
        return  # a worker (the controller set it up) or the user's own choice
    directory = tempfile.mkdtemp(prefix="volta_train-test-kernels-")
    os.environ[CACHE_DIR_ENV] = os.environ[_RUN_CACHE] = directory


def pytest_unconfigure(config):
    directory = os.environ.get(_RUN_CACHE)
    if directory and not hasattr(config, "workerinput"):
        shutil.rmtree(directory, ignore_errors=True)
        os.environ.pop(_RUN_CACHE, None)
        if os.environ.get(CACHE_DIR_ENV) == directory:
            del os.environ[CACHE_DIR_ENV]


# Tests that start several training processes through `accelerate launch` (or gloo groups of their own) carry the
# `launches_processes` mark: under pytest-xdist (README's `-n 2 --dist loadgroup`) they share one worker, so that two
# never race for accelerate's rendezvous port (29500).
LAUNCHES_PROCESSES = "launches_processes"
# Tests that compile many kernel variants into the run's cache share one worker too: the first compiles, the others
# load its entries (on two workers they would wait on each other's per-kernel locks).
COMPILES_KERNELS = "compiles_kernels"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the xdist_group marks added here
def pytest_collection_modifyitems(config, items):
    """The one GPU-skip hook (tests/ and lab/tests/): gpu-marked tests skip without a CUDA GPU."""
    has_gpu = torch.cuda.is_available()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
        if LAUNCHES_PROCESSES in item.keywords:
            item.add_marker(pytest.mark.xdist_group("launches-processes"))
        elif COMPILES_KERNELS in item.keywords:
            item.add_marker(pytest.mark.xdist_group("compiles-kernels"))
