"""``python -m sketchcal``."""

import os
import sys

# ``python -m`` puts the working directory first on sys.path. In a checkout that is the repository
# root, whose kernels/ folder (installed as ``sketchcal.kernels``) would shadow the ``kernels``
# package that transformers imports.
_first = os.path.abspath(sys.path[0] or os.curdir) if sys.path else ""
if os.path.isfile(os.path.join(_first, "kernels", "__init__.py")) and os.path.isdir(
    os.path.join(_first, "sketchcal")
):
    del sys.path[0]

from sketchcal.cli import main  # noqa: E402

main()
