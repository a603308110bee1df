"""Every launch of the decode kernels compiles for sm_90 with Triton's own ptxas, no GPU needed.

The other CPU tests run the kernels in Triton's interpreter, which lets through what only the
compiler checks: a constexpr assigned twice, a mismatched type.
``python -m sketchcal.kernels.resources check`` compiles every default launch shape and tuning
candidate, in both modes and over 1 and 3 tokens. It runs in a subprocess, because this
directory's conftest sets ``TRITON_INTERPRET`` for the interpreter tests, and Triton reads it when
a kernel is decorated.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

ROOT = Path(__file__).resolve().parents[2]
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton build ships no ptxas")
def test_every_launch_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.6's default, as on the device
    r = subprocess.run(
        [sys.executable, "-m", "sketchcal.kernels.resources", "check"],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    last = r.stdout.strip().splitlines()[-1]
    done, _, total = last.split()[:3]
    assert done == total and int(total) > 50, last
