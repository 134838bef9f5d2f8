"""ampdoctor: find where and why a PyTorch mixed-precision training run breaks.

>>> import ampdoctor
>>> w = ampdoctor.watch(model)        # record per-layer statistics against fp16
>>> ...train...
>>> print(w.report())                # per-layer overflow report
>>> ampdoctor.keep_fp32(model.blocks[1].attn)   # the fix bisect names
"""

from __future__ import annotations

import logging
from typing import Any

from .formats import FORMATS, Format, get_format
from .watch import Watch, watch

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())


def keep_fp32(module: Any) -> Any:
    """Run ``module`` in FP32 under autocast from now on (the fix ``ampdoctor bisect`` names).
    Returns a handle whose ``remove()`` undoes it."""
    from .precision import keep_fp32 as _keep_fp32
    return _keep_fp32(module)


from . import bisect  # noqa: E402  (a callable package: ampdoctor.bisect(train_fn))

__all__ = ["watch", "Watch", "keep_fp32", "bisect", "Format", "FORMATS", "get_format", "__version__"]
