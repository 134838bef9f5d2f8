"""Bisection: find the modules whose FP32 cast stops a mixed-precision run from breaking,
then name the op inside them that overflows.

``search`` is the pure search (no processes); ``drill`` the op-level drill-down.
"""

from __future__ import annotations

from .drill import OpFinding, OpProbe, drill_down
from .search import Disagreement, Outcome, SearchResult, Trial, find_culprits

__all__ = ["find_culprits", "SearchResult", "Trial", "Disagreement", "Outcome",
           "OpProbe", "OpFinding", "drill_down"]
