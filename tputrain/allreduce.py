"""Moved to `tputrain.distribution.allreduce`: this old name is an alias of that module
(importing it warns; import `tputrain.distribution.allreduce` instead)."""

import sys
import warnings

from tputrain.distribution import allreduce as _moved

warnings.warn("tputrain.allreduce moved to tputrain.distribution.allreduce", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _moved
