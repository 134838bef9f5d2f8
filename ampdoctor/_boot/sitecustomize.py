"""On ``PYTHONPATH`` only while ``ampdoctor run``/``bisect`` runs a script (see
:mod:`ampdoctor.rank_boot`): a rank that the script launches itself, by running its own file again
(PyTorch Lightning's DDP launcher, ``subprocess`` with ``LOCAL_RANK``), is run under ampdoctor as the
first one is, with the same configuration (its own trace, the same layers forced to FP32). Any other
process started meanwhile only pays a few environment look-ups here (ampdoctor is not imported), gets
``PYTHONPATH`` and ``sys.path`` as they were, and a ``sitecustomize`` of the user's, further on the
path, still runs. The variable names are :mod:`ampdoctor.rank_boot`'s."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _restore_path() -> None:
    saved = os.environ.get("AMPDOCTOR_PYTHONPATH")
    if saved is not None:
        if saved == "<unset>":
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]


def _chain() -> None:
    """The next ``sitecustomize`` on the path (the user's or the environment's), as if this one were not here."""
    import importlib

    mine = sys.modules.pop("sitecustomize", None)
    try:
        importlib.import_module("sitecustomize")
    except ModuleNotFoundError as e:
        if e.name != "sitecustomize":
            raise
        if mine is not None:
            sys.modules["sitecustomize"] = mine


def _is_self_launched_rank() -> bool:
    script = os.environ.get("AMPDOCTOR_SCRIPT")
    if not script or not os.environ.get("AMPDOCTOR_CONFIG") or not sys.argv or not sys.argv[0]:
        return False
    if os.environ.get("AMPDOCTOR_SCRIPT_PID") == str(os.getpid()):
        return False
    if not any(os.environ.get(v, "").isdigit() and int(os.environ[v]) > 0 for v in ("LOCAL_RANK", "RANK")):
        return False  # not another rank: a helper process that happens to run the same file
    try:
        return os.path.realpath(sys.argv[0]) == os.path.realpath(script)
    except (OSError, ValueError):
        return False


_restore_path()
_chain()
if _is_self_launched_rank():
    from ampdoctor.rank_boot import take_over

    take_over()  # runs the script under ampdoctor and ends the process
