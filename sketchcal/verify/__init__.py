"""Verification: accuracy and traffic of a converted model's sketch against the full-state model.

Public API::

    verify(model_dir, **options) -> VerifyResult      # options: sketchcal.settings.VerifySettings

Modules: ``run`` (configurations and the teacher-forced runs), ``metrics`` (KL, top-1, perplexity,
read error), ``retrieval`` (associative recall), ``report`` (table, JSON, markdown, plots).
"""

from sketchcal.verify.run import ConfigResult, RunConfig, VerifyResult, verify

__all__ = ["ConfigResult", "RunConfig", "VerifyResult", "verify"]
