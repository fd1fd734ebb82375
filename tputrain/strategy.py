"""Moved to `tputrain.distribution.strategy`: this old name is an alias of that module
(importing it warns; import `tputrain.distribution.strategy` instead)."""

import sys
import warnings

from tputrain.distribution import strategy as _moved

warnings.warn("tputrain.strategy moved to tputrain.distribution.strategy", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _moved
