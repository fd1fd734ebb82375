"""Moved to `tputrain.distribution.launch`: this old name is an alias of that module
(importing it warns; import `tputrain.distribution.launch` instead)."""

import sys
import warnings

from tputrain.distribution import launch as _moved

warnings.warn("tputrain.launch moved to tputrain.distribution.launch", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _moved
