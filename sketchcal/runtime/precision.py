"""Storage precisions of the decode state: the fp32 checkpoint, the read copy / sketch, the math.

Two precisions (the default when ``read_dtype`` is low): the checkpoint that takes updates stays
``state_dtype`` (fp32) and a read copy (or the sketch) in ``read_dtype`` is written at each flush;
rounding in the copy never feeds a later update. ``shared=True`` is the comparison point: the single
checkpoint itself is stored in ``read_dtype``, so its rounding is folded into every later window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sketchcal.errors import SketchcalError

_NAMES: dict[str, str] = {
    "fp32": "float32",
    "float32": "float32",
    "f32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "float8": "float8_e4m3fn",
    "float8_e4m3fn": "float8_e4m3fn",
    "fp64": "float64",
    "float64": "float64",
}
READ_DTYPES = ("fp32", "bf16", "fp16", "fp8")


def parse_dtype(value: str | torch.dtype, what: str = "--read-dtype") -> torch.dtype:
    """A torch dtype from a name (``fp32``, ``bf16``, ``fp16``, ``fp8`` = e4m3, ...) or a dtype."""
    if isinstance(value, torch.dtype):
        return value
    name = _NAMES.get(str(value).lower().removeprefix("torch."))
    dtype = getattr(torch, name, None) if name else None
    if dtype is None:
        if name == "float8_e4m3fn":
            raise SketchcalError(f"{what} fp8: this torch build has no float8_e4m3fn; use bf16 or fp16")
        raise SketchcalError(f"{what} must be one of {', '.join(READ_DTYPES)}, got {value!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """Short name of a dtype as the CLI spells it (``fp32``, ``bf16``, ``fp16``, ``fp8``)."""
    short = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
    if dtype in short:
        return short[dtype]
    return "fp8" if "float8" in str(dtype) else str(dtype).removeprefix("torch.")


def store(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` rounded to ``dtype`` for storage; fp8 saturates at its finite range instead of overflowing."""
    if dtype.itemsize == 1 and dtype.is_floating_point:
        fmax = torch.finfo(dtype).max
        t = t.clamp(-fmax, fmax)
    return t.to(dtype)


@dataclass(frozen=True)
class Precision:
    """Dtypes of one decode state.

    ``state_dtype``: the checkpoint that takes updates (fp32). ``read_dtype``: the read copy / sketch.
    ``shared``: store the checkpoint itself in ``read_dtype`` (single low-precision state, the
    ablation). ``compute_dtype``: the math (fp32; float64 for references and tests).
    """

    read_dtype: torch.dtype = torch.float32
    shared: bool = False
    state_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32

    @classmethod
    def from_names(
        cls,
        read_dtype: str | torch.dtype = "fp32",
        shared: bool = False,
        state_dtype: str | torch.dtype = "fp32",
        compute_dtype: str | torch.dtype = "fp32",
    ) -> Precision:
        return cls(
            parse_dtype(read_dtype),
            bool(shared),
            parse_dtype(state_dtype, "state dtype"),
            parse_dtype(compute_dtype, "compute dtype"),
        )

    @property
    def checkpoint_dtype(self) -> torch.dtype:
        return self.read_dtype if self.shared else self.state_dtype

    @property
    def separate_read_copy(self) -> bool:
        """True when reads come from a copy written at each flush (two precisions)."""
        return self.read_dtype != self.checkpoint_dtype

    def describe(self) -> str:
        if not self.separate_read_copy:
            return f"{dtype_name(self.checkpoint_dtype)}" + (" shared" if self.shared else "")
        return f"{dtype_name(self.state_dtype)} checkpoint + {dtype_name(self.read_dtype)} read copy"
