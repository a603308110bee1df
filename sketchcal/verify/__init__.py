"""Verification: accuracy and traffic of a converted model's sketch against the full-state model.

Public API::

    verify(model_dir, baseline=None, data=None, tokens=128, rank=None, *, out=None, prompt=32,
           samples=16, batch_size=8, read_dtype=None, stats=None, ablations=True, retrieval=True,
           plots=True, device="auto", seed=0, command=None, progress=True) -> VerifyResult

Modules: ``run`` (configurations and the teacher-forced runs), ``metrics`` (KL, top-1, perplexity,
read error), ``retrieval`` (associative recall), ``report`` (table, JSON, markdown, plots).
"""

from sketchcal.verify.run import ConfigResult, RunConfig, VerifyResult, verify

__all__ = ["ConfigResult", "RunConfig", "VerifyResult", "verify"]
