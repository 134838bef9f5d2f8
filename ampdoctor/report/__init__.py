"""Reports built from a trace alone (text, JSON; HTML and plots live beside them).

``build_report(trace_or_run_dir)`` -> :class:`~ampdoctor.report.model.Report`.
matplotlib is imported only by the HTML/plot modules.
"""

from .model import LayerRow, Report, build_report

__all__ = ["build_report", "Report", "LayerRow"]
