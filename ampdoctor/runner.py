"""Running a user's script in this process, under a session, as pdb and memray do:
``sys.argv`` rewritten, the script's folder first on ``sys.path``, ``runpy.run_path`` as
``__main__``, everything restored afterwards."""

from __future__ import annotations

import logging
import math
import os
import runpy
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from . import rank_boot
from .config import RunConfig
from .session import Session, StopRun, _set_current

log = logging.getLogger(__name__)

# exit statuses of `ampdoctor run` besides the script's own
EXIT_NEVER_TRAINED = 3


class ScriptNotFound(FileNotFoundError):
    pass


@dataclass
class ScriptResult:
    status: str               # finished | stopped | crashed | exited | interrupted
    exit_code: int
    trace: str
    steps: int
    optimizer_steps: int
    error: str | None = None  # "ExcType: message" when the script raised
    traceback: str | None = None
    stop_reason: str | None = None
    decision: Any = None
    trained: bool = True      # at least one step boundary (optimizer step / GradScaler update) ran
    completed: int = 0        # steps that reached their boundary (``steps`` counts one cut short too)


def _user_traceback(exc: BaseException, script: Path) -> str:
    """The traceback from the script's first frame on (our runner's frames dropped). None of the
    frames is the script's when it could not be compiled (a SyntaxError: its own lines say where)
    or read: then the exception alone."""
    frames = traceback.extract_tb(exc.__traceback__)
    start = len(frames)
    for i, fr in enumerate(frames):
        if Path(fr.filename).resolve() == script:
            start = i
            break
    lines = ["Traceback (most recent call last):\n"] + traceback.format_list(frames[start:]) if start < len(frames) else []
    lines += traceback.format_exception_only(type(exc), exc)
    return "".join(lines)


def script_problem(script: str | os.PathLike) -> str | None:
    """Why ``script`` cannot be run as a training script (a message that says what to give), or None."""
    path = Path(script)
    if path.is_file():
        return notebook_problem(path)
    if path.is_dir():
        return f"{script} is a directory, not a script (give the path of a Python training script in it)"
    return f"script not found: {script} (give the path of a Python training script)"


def notebook_problem(script: str | os.PathLike) -> str | None:
    """A Jupyter notebook is JSON, not Python: say how to run it under ampdoctor instead."""
    if Path(script).suffix.lower() != ".ipynb":
        return None
    return (f"{script} is a Jupyter notebook, not a Python script: export it to one "
            f"(`jupyter nbconvert --to script {script}`) and give the .py, or call `ampdoctor.watch(model)` "
            "(or `ampdoctor.bisect(train_fn)`) inside the notebook")


def run_script(script: str | os.PathLike, args: Sequence[str], config: RunConfig,
               on_hard_exit: Callable[[ScriptResult], None] | None = None) -> ScriptResult:
    """Run ``script`` with ``args`` under a session configured by ``config``. Never raises for the
    script's own failures: they come back in the result, with everything recorded kept.
    ``on_hard_exit``: called with the result when the script ends the process itself with
    ``os._exit()`` (no return from here then), before the process exits."""
    problem = script_problem(script)
    if problem:
        raise ScriptNotFound(problem)
    path = Path(script).resolve()
    saved_env = os.environ.get("AMPDOCTOR_CONFIG")
    os.environ["AMPDOCTOR_CONFIG"] = config.to_env()  # child processes (DataLoader workers, torchrun) see it
    armed = rank_boot.arm(path)  # ranks the script starts by running its own file again run under ampdoctor too
    session = Session(config, owned=True)
    _set_current(session)
    probes: list[Any] = []
    if config.probe:
        session.on_attach.append(lambda w: _attach_probe(w, config, probes))
    auto = None
    if config.auto_watch:
        from .autowatch import AutoWatch
        auto = AutoWatch(session)
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    saved_main = sys.modules.get("__main__")
    sys.argv = [str(path), *args]
    sys.path.insert(0, str(path.parent))
    real_exit, pid = os._exit, os.getpid()
    done: list[ScriptResult] = []

    def finish(status: str, code: int, err: str | None = None, tb: str | None = None,
               stop_reason: str | None = None, decision: Any = None) -> ScriptResult:
        if done:
            return done[0]
        os._exit = real_exit
        sys.argv[:] = saved_argv
        sys.path[:] = saved_path
        if saved_main is not None:
            sys.modules["__main__"] = saved_main
        if auto is not None:
            auto.remove()
        for probe in probes:
            _write_probe(session, probe)
        steps, opt_steps = session.step, session.optimizer_steps
        completed = steps
        trained = steps > 0 or opt_steps > 0
        extra = {"error": err} if err else {}
        if stop_reason:
            extra["stop_reason"] = stop_reason
        session.close(status={"finished": "finished", "stopped": "finished"}.get(status, status), exit_code=code, **extra)
        steps = max(steps, session.step)
        decision = decision if decision is not None else session.decision
        rank_boot.disarm(armed)
        if saved_env is None:
            os.environ.pop("AMPDOCTOR_CONFIG", None)
        else:
            os.environ["AMPDOCTOR_CONFIG"] = saved_env
        done.append(ScriptResult(status=status, exit_code=code, trace=str(session.trace_path), steps=steps,
                                 optimizer_steps=opt_steps, error=err, traceback=tb, stop_reason=stop_reason,
                                 decision=decision, trained=trained, completed=completed))
        return done[0]

    def hard_exit(n: int) -> None:
        # os._exit() skips every except and finally: the run ends here, as it would on sys.exit (not in a
        # forked child, such as a DataLoader worker, which ends its own process this way)
        if os.getpid() == pid:
            try:
                result = finish("finished" if n == 0 else "exited", int(n))
                if on_hard_exit is not None:
                    on_hard_exit(result)
            except BaseException as e:  # noqa: BLE001 - the exit must happen
                log.warning("ampdoctor: could not end the run at os._exit(): %s: %s", type(e).__name__, e)
        real_exit(n)

    os._exit = hard_exit
    status, code, err, tb, stop_reason, decision = "finished", 0, None, None, None, None
    try:
        runpy.run_path(str(path), run_name="__main__")
    except StopRun as e:
        status, stop_reason, decision = "stopped", e.reason, e.decision
    except SystemExit as e:
        if e.code is None or e.code == 0:
            status, code = "finished", 0
        elif isinstance(e.code, int):
            status, code = "exited", e.code
        else:
            status, code, err = "exited", 1, str(e.code)
    except KeyboardInterrupt:
        status, code, err = "interrupted", 130, "KeyboardInterrupt"
    except BaseException as e:  # the user's script failed: keep its cause, not ours
        status, code = "crashed", 1
        err = f"{type(e).__name__}: {e}"
        tb = _user_traceback(e, path)
    finally:
        result = finish(status, code, err, tb, stop_reason, decision)
    return result


def _attach_probe(watch: Any, config: RunConfig, probes: list) -> None:
    """Drill-down: an op-level probe inside the named modules of this watch's model."""
    from .bisect.drill import OpProbe

    names = {n for n, _ in watch.root.named_modules()}
    mine = [n[len(watch.prefix):] for n in config.probe if n.startswith(watch.prefix) and n[len(watch.prefix):] in names]
    if not mine:
        return
    probe = OpProbe(watch.root, mine, config.format)
    probe.__enter__()
    probe.prefix = watch.prefix
    probe.step = watch.session.step
    watch.session.on_step.append(lambda step: setattr(probe, "step", step))
    probes.append(probe)


def _write_probe(session: Session, probe: Any) -> None:
    try:
        probe.remove()
        picks = [probe.first, probe.worst, probe.worst_backward]
        written: set[int] = set()  # a pick is one of the findings too: one event each
        for f in [*picks, *probe.findings[:50]]:
            if f is None or id(f) in written:
                continue
            written.add(id(f))
            d = f.to_dict()
            d["layer"] = probe.prefix + d["layer"]
            d.pop("step", None)
            session.writer.add_event(f.step, "op", d["layer"], pick=("first" if f is picks[0] else
                                     "worst" if f is picks[1] else "worst_backward" if f is picks[2] else "seen"), **{
                                         k: v for k, v in d.items() if k != "layer"})
        for name, (absmax, step) in probe.inputs_beyond.items():
            session.writer.add_event(step, "probe_input", probe.prefix + name,
                                     absmax=absmax if math.isfinite(absmax) else None,
                                     first_step=probe.inputs_first.get(name, step))
        session.writer.add_event(None, "probe", None, ops_seen=probe.ops_seen, findings=len(probe.findings))
    except Exception as e:  # the drill-down must never lose the trace
        log.warning("ampdoctor: op probe failed: %s", e)
