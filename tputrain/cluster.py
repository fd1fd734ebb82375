"""Moved to `tputrain.distribution.cluster`: this old name is an alias of that module
(importing it warns; import `tputrain.distribution.cluster` instead)."""

import sys
import warnings

from tputrain.distribution import cluster as _moved

warnings.warn("tputrain.cluster moved to tputrain.distribution.cluster", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _moved
