import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def pytest_configure(config):
    """Under pytest-xdist, each worker takes its share of the cores: N workers each running torch
    on every core oversubscribe the machine, and tests that wait on CPU work then stall."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_runtime_leaks():
    """A runtime left enabled by one test (e.g. inside an lm-eval model object) must not keep the
    transformers modeling modules patched for the next."""
    yield
    from sketchcal.runtime.patch import _ENABLED

    for runtime in list(_ENABLED.values()):
        runtime.disable()
