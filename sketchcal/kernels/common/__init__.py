from sketchcal.kernels.common.recurrence import (
    Family,
    StepInputs,
    effective_queries,
    product_form_read,
    recurrence,
    step,
)

__all__ = [
    "Family",
    "StepInputs",
    "effective_queries",
    "product_form_read",
    "recurrence",
    "step",
]


def family(name: str) -> Family:
    """The reference :class:`Family` for ``"mamba2"``, ``"gdn"`` or ``"kda"``."""
    if name == "mamba2":
        from sketchcal.kernels.mamba2.naive import FAMILY
    elif name == "gdn":
        from sketchcal.kernels.gdn.naive import FAMILY
    elif name == "kda":
        from sketchcal.kernels.kda.naive import FAMILY
    else:
        raise ValueError(f"unknown family {name!r}; expected one of mamba2, gdn, kda")
    return FAMILY
