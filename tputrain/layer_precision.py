"""Moved to `tputrain.precision.layers`: this old name is an alias of that module
(importing it warns; import `tputrain.precision.layers` instead)."""

import sys
import warnings

from tputrain.precision import layers as _moved

warnings.warn("tputrain.layer_precision moved to tputrain.precision.layers", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _moved
