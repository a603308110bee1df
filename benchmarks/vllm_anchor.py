"""vLLM's Mamba-2 decode kernel as ``sketchcal bench``'s anchor, without installing vLLM.

``sketchcal bench --family mamba2`` times vLLM's Triton ``selective_state_update`` when
``vllm.model_executor.layers.mamba.ops.mamba_ssm`` imports. Where vLLM itself cannot be installed
(its wheel pins another torch), this script takes that file, its ``triton_helpers.py`` and its tuned
configs out of a vLLM wheel and writes stand-ins for the vLLM modules they import, each returning
what vLLM returns on a CUDA machine, so that the kernel runs as vLLM runs it.

Usage::

    pip download --no-deps vllm==0.33.0 -d wheels/
    python benchmarks/vllm_anchor.py wheels/vllm-0.33.0-*.whl anchors/
    PYTHONPATH=anchors sketchcal bench --family mamba2 --batch 256
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path
from typing import NoReturn

OPS = "vllm/model_executor/layers/mamba/ops/"
TAKEN = (OPS + "mamba_ssm.py", OPS + "triton_helpers.py")
CONFIGS = OPS + "configs/"
PACKAGES = (
    "vllm",
    "vllm/model_executor",
    "vllm/model_executor/layers",
    "vllm/model_executor/layers/mamba",
    "vllm/model_executor/layers/mamba/ops",
    "vllm/utils",
    "vllm/v1",
    "vllm/v1/attention",
    "vllm/v1/attention/backends",
)
STAND_INS = {
    "vllm/envs.py": "VLLM_TUNED_CONFIG_FOLDER = None\n",
    "vllm/_custom_ops.py": "# stand-in: selective_state_update calls no custom op\n",
    "vllm/logger.py": """import logging


class _Logger(logging.LoggerAdapter):
    def info_once(self, msg, *args, scope=None, **kwargs):
        self.info(msg, *args, **kwargs)

    def warning_once(self, msg, *args, scope=None, **kwargs):
        self.warning(msg, *args, **kwargs)


def init_logger(name):
    return _Logger(logging.getLogger(name), {})
""",
    "vllm/platforms/__init__.py": """import torch


class _Cuda:
    def is_xpu(self):
        return False

    def is_cpu(self):
        return False

    def is_cuda(self):
        return True

    def get_device_name(self, device_id=0):
        return torch.cuda.get_device_name(device_id)


current_platform = _Cuda()
""",
    "vllm/triton_utils/__init__.py": "import triton\nimport triton.language as tl\n\nHAS_TRITON = True\n",
    "vllm/utils/platform_utils.py": """import re


def get_device_name_as_file_name(device_id=0):
    from vllm.platforms import current_platform

    return re.sub(r"[\\s/]+", "_", current_platform.get_device_name(device_id))
""",
    "vllm/v1/attention/backends/utils.py": "NULL_BLOCK_ID = 0\n",
}


def fail(message: str) -> NoReturn:
    """A one-line error on stderr, exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def extract(wheel: Path, out: Path) -> list[str]:
    """Write the kernel files, their tuned configs and the stand-ins under ``out``; returns the
    files written (relative paths)."""
    if out.exists() and any(out.iterdir()):
        fail(f"{out} is not empty: give a new directory")
    try:
        archive = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as err:
        fail(f"{wheel} is not a readable wheel ({err}); download one with pip download")
    with archive:
        names = set(archive.namelist())
        missing = [n for n in TAKEN if n not in names]
        if missing:
            fail(f"{wheel} has no {', '.join(missing)}: use a vLLM wheel of 0.33 or near it")
        files = {n: archive.read(n).decode() for n in TAKEN}
        configs = sorted(n for n in names if n.startswith(CONFIGS) and n.endswith(".json"))
        files |= {n: archive.read(n).decode() for n in configs}
    files |= STAND_INS
    files |= {f"{p}/__init__.py": "" for p in PACKAGES if f"{p}/__init__.py" not in files}
    for name, text in files.items():
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return sorted(files)


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        fail("usage: python benchmarks/vllm_anchor.py VLLM_WHEEL OUT_DIR")
    written = extract(Path(argv[0]), Path(argv[1]))
    print(f"wrote {len(written)} files under {argv[1]}; run with PYTHONPATH={argv[1]}")


if __name__ == "__main__":
    main(sys.argv[1:])
