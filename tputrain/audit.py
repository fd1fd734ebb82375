"""Moved to `tputrain.precision.audit`: this old name is an alias of that module
(importing it warns; import `tputrain.precision.audit` instead)."""

import sys
import warnings

from tputrain.precision import audit as _moved

warnings.warn("tputrain.audit moved to tputrain.precision.audit", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _moved
