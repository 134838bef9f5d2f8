"""Ranks that a script launches itself. ``ampdoctor run``/``bisect`` run the script in their own
process (:func:`ampdoctor.runner.run_script`); a framework that starts the other ranks of a DDP run
by running the script's file again (PyTorch Lightning's default DDP launcher: ``python script.py
ARGS`` with ``LOCAL_RANK`` set) would run them without ampdoctor: no trace of theirs, and in a
bisect trial, their layers not forced to FP32 while rank 0's are (the averaged gradients then
mix both). While a script runs, ``PYTHONPATH`` starts with ``ampdoctor/_boot``, whose
``sitecustomize`` calls :func:`take_over` in every Python process started meanwhile: in such a rank
it runs the script under :func:`ampdoctor.runner.run_script` with the same configuration (its trace
is ``trace.rankN.sqlite``) and ends the process with the script's exit status."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# (_boot/sitecustomize.py reads these names without importing ampdoctor: keep them in step)
SCRIPT_VAR = "AMPDOCTOR_SCRIPT"        # the script being run (resolved path)
PARENT_VAR = "AMPDOCTOR_SCRIPT_PID"    # the process that runs it
SAVED_VAR = "AMPDOCTOR_PYTHONPATH"     # PYTHONPATH as it was (UNSET: it was not set)
UNSET = "<unset>"
BOOT = str(Path(__file__).resolve().parent / "_boot")
STOPPED_GRACE = 30.0  # seconds a rank decided before rank 0 waits for rank 0's launcher to end it


def arm(script: Path) -> dict[str, str | None]:
    """Before the script runs: the environment its self-launched ranks inherit. Returns what to
    give :func:`disarm` after."""
    saved = {k: os.environ.get(k) for k in (SCRIPT_VAR, PARENT_VAR, SAVED_VAR, "PYTHONPATH")}
    pp = os.environ.get("PYTHONPATH")
    os.environ[SAVED_VAR] = UNSET if pp is None else pp
    os.environ["PYTHONPATH"] = BOOT if not pp else BOOT + os.pathsep + pp
    os.environ[SCRIPT_VAR] = str(script)
    os.environ[PARENT_VAR] = str(os.getpid())
    return saved


def disarm(saved: dict[str, str | None]) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def take_over() -> None:
    """In a rank that the script launched by running its file again (``_boot/sitecustomize.py``
    tells): run it under ampdoctor and end the process with its exit status."""
    from .config import RunConfig
    from .runner import run_script

    cfg = RunConfig.from_env()
    if cfg is None:
        return
    launcher = os.environ.get(PARENT_VAR, "")
    os.environ[PARENT_VAR] = str(os.getpid())  # (this rank's own children are not ranks of it)
    res = run_script(sys.argv[0], sys.argv[1:], cfg)
    code = res.exit_code
    if res.status == "stopped":
        # decided at the same step as rank 0, whose launcher ends this process when rank 0 stops; ending
        # first would break rank 0's next collective call and turn its result into a crash
        _wait_for_exit(int(launcher) if launcher.isdigit() else None, STOPPED_GRACE)
        code = 0
    elif res.status == "crashed" and res.traceback:
        sys.stderr.write(res.traceback if res.traceback.endswith("\n") else res.traceback + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _wait_for_exit(pid: int | None, seconds: float) -> None:
    """Until process ``pid`` has ended, at most ``seconds``."""
    import time

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if pid is not None:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            except OSError:  # (not ours to signal: it is alive)
                pass
            try:  # ended, but nobody reaped it (this process's parent: a zombie until then)
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[-1].split()[0] == "Z":
                        return
            except (OSError, IndexError):
                pass
        time.sleep(0.1)
