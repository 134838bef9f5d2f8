"""Bisection: find the modules whose FP32 cast stops a mixed-precision run from breaking,
then name the op inside them that overflows.

``search`` is the pure search (no processes); ``drill`` the op-level drill-down.
"""

from __future__ import annotations

from .drill import OpFinding, OpProbe, drill_down
from .search import Disagreement, Outcome, SearchResult, Trial, find_culprits

__all__ = ["find_culprits", "SearchResult", "Trial", "Disagreement", "Outcome",
           "OpProbe", "OpFinding", "drill_down"]


def bisect(train_fn, **kwargs):
    """``ampdoctor.bisect(train_fn)``: see :func:`ampdoctor.bisect.api.bisect`."""
    from .api import bisect as _bisect

    return _bisect(train_fn, **kwargs)


class _CallableModule(__import__("types").ModuleType):
    """Importing the subpackage binds ``ampdoctor.bisect`` to it, shadowing the public function
    of the same name; calling the package calls the function, so both spellings keep working."""

    def __call__(self, train_fn, **kwargs):
        return bisect(train_fn, **kwargs)


__import__("sys").modules[__name__].__class__ = _CallableModule
