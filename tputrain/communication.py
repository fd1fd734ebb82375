"""Moved to `tputrain.distribution.communication`: this old name is an alias of that module
(importing it warns; import `tputrain.distribution.communication` instead)."""

import sys
import warnings

from tputrain.distribution import communication as _moved

warnings.warn("tputrain.communication moved to tputrain.distribution.communication",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
