"""benchmarks/vllm_anchor.py: vLLM's Mamba-2 decode kernel taken out of a wheel, with stand-ins for
the vLLM modules it imports.

The wheel here is a small zip with vLLM's layout whose ``mamba_ssm.py`` makes every vLLM import the
0.33 file makes; the stand-ins must satisfy each of them with what vLLM gives on a CUDA machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

from helpers import ROOT

SCRIPT = ROOT / "benchmarks" / "vllm_anchor.py"
OPS = "vllm/model_executor/layers/mamba/ops/"
CONFIG = OPS + "configs/selective_state_update/headdim=64,dstate=128,device_name=NVIDIA_H200.json"
# vLLM 0.33's mamba_ssm.py imports, and the names it uses from them
KERNEL = """
import vllm.envs as envs
from vllm import _custom_ops as ops
from vllm.logger import init_logger
from vllm.model_executor.layers.mamba.ops.triton_helpers import fast_exp
from vllm.platforms import current_platform
from vllm.triton_utils import HAS_TRITON, tl, triton
from vllm.utils.platform_utils import get_device_name_as_file_name
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID

logger = init_logger(__name__)
logger.info_once("config from %s", "x", scope="global")
logger.warning_once("default config", scope="global")


def selective_state_update():
    return envs.VLLM_TUNED_CONFIG_FOLDER, NULL_BLOCK_ID, HAS_TRITON, current_platform.is_xpu(), fast_exp
"""


def _wheel(path, files):
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True)


def test_the_kernel_imports_from_the_stand_ins(tmp_path):
    files = {
        OPS + "mamba_ssm.py": KERNEL,
        OPS + "triton_helpers.py": "def fast_exp(x):\n    return x\n",
        CONFIG: json.dumps({"256": [4, 4]}),
        "vllm/entrypoints/api.py": "raise ImportError('not taken')\n",
    }
    wheel = _wheel(tmp_path / "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl", files)
    out = tmp_path / "anchors"
    done = _run(wheel, out)
    assert done.returncode == 0, done.stderr
    assert (out / CONFIG).read_text() == files[CONFIG] and not (out / "vllm/entrypoints").exists()
    check = (
        "from vllm.model_executor.layers.mamba.ops.mamba_ssm import selective_state_update as f;print(f())"
    )
    env = dict(os.environ, PYTHONPATH=str(out))
    got = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=env)
    assert got.returncode == 0, got.stderr
    assert got.stdout.startswith("(None, 0, True, False, <function fast_exp")


def test_bad_inputs_are_one_line_errors(tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    (full / "kept.txt").write_text("x")
    not_a_wheel = tmp_path / "vllm.whl"
    not_a_wheel.write_text("text")
    other = _wheel(tmp_path / "other.whl", {"other/__init__.py": ""})
    for args, match in [
        ((other, full), "is not empty"),
        ((not_a_wheel, tmp_path / "a"), "not a readable wheel"),
        ((tmp_path / "missing.whl", tmp_path / "b"), "not a readable wheel"),
        ((other, tmp_path / "c"), "has no vllm/model_executor"),
        ((other,), "usage"),
    ]:
        done = _run(*args)
        assert done.returncode == 2 and match in done.stderr, (args, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1
    assert (full / "kept.txt").read_text() == "x" and not (tmp_path / "c").exists()
