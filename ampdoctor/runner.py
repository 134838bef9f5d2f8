"""Running a user's script in this process, under a session, as pdb and memray do:
``sys.argv`` rewritten, the script's folder first on ``sys.path``, ``runpy.run_path`` as
``__main__``, everything restored afterwards."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import runpy
import shlex
import signal
import sys
import threading
import traceback
from dataclasses import dataclass, field
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
    children: list[str] = field(default_factory=list)  # processes the script started to run its code (see _ChildWatch)


class _ChildWatch:
    """While the script runs: the Python processes it starts through ``multiprocessing`` (what
    ``torch.multiprocessing.spawn`` uses) to run a function of its own, by what they run. ampdoctor
    follows only the process it runs the script in, so a script that trains in such processes trains
    unseen. DataLoader workers are not counted (they load data). Undone by :meth:`remove`."""

    def __init__(self) -> None:
        import multiprocessing.process as mpp

        self.started: list[str] = []
        self._cls, self._real = mpp.BaseProcess, mpp.BaseProcess.start
        real, started = self._real, self.started

        def start(proc: Any) -> None:
            what = _child_target(proc)
            if what is not None:
                started.append(what)
            real(proc)

        self._cls.start = start

    def remove(self) -> None:
        self._cls.start = self._real


def _child_target(proc: Any) -> str | None:
    """What a ``multiprocessing`` process about to start runs: ``torch.multiprocessing.spawn(fn)`` or
    ``multiprocessing.Process(fn)``; None for a DataLoader worker, or a process of no function."""
    target = getattr(proc, "_target", None)
    if target is None:
        return None
    module = getattr(target, "__module__", "") or ""
    if module.startswith("torch.utils.data"):
        return None
    args = getattr(proc, "_args", ()) or ()
    if module == "torch.multiprocessing.spawn" and args and callable(args[0]):
        return f"torch.multiprocessing.spawn({getattr(args[0], '__qualname__', repr(args[0]))})"
    return f"multiprocessing.Process({getattr(target, '__qualname__', repr(target))})"


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


PYTHON_SUFFIXES = ("", ".py", ".pyw", ".pyz")  # what Python runs as a script (none: `#!/usr/bin/env python` files)


def script_problem(script: str | os.PathLike) -> str | None:
    """Why ``script`` cannot be run as a training script (a message that says what to give), or None."""
    path = Path(script)
    if path.is_file():
        return notebook_problem(path)
    if path.is_dir():
        return f"{script} is a directory, not a script (give the path of a Python training script in it)"
    return f"script not found: {script} (give the path of a Python training script)"


def launch_problem(script: str | os.PathLike) -> str | None:
    """What ``ampdoctor run``/``bisect`` refuse before anything runs: :func:`script_problem`; a file
    not named as Python source (``.txt``, ``.sh``, ``.yaml``: a config or a launcher given by mistake);
    one that does not compile (its syntax error, said plainly, not a report of a run that never
    trained; :func:`run_script` itself runs it and returns the error as the script's)."""
    problem = script_problem(script)
    if problem:
        return problem
    path = Path(script)
    if path.suffix.lower() not in PYTHON_SUFFIXES:
        return (f"{script} is not a Python script ({path.suffix} file): give the .py training script "
                "(for a shell launcher, the .py it starts, with its arguments after the script's name)")
    return compile_problem(path)


def compile_problem(path: Path) -> str | None:
    """The syntax error that stops ``path`` from running, said plainly (file:line, message, the line),
    or None when it compiles (or is a zip archive, which Python runs as a whole)."""
    import tokenize
    import warnings
    import zipfile

    try:
        if zipfile.is_zipfile(path):
            return None
        with tokenize.open(path) as f:  # (the encoding its coding line declares)
            source = f.read()
        with warnings.catch_warnings():  # (a SyntaxWarning is said again when the script runs)
            warnings.simplefilter("ignore")
            compile(source, str(path), "exec", dont_inherit=True)
    except SyntaxError as e:  # (IndentationError, TabError too)
        where = f"{path}:{e.lineno}" if e.lineno else str(path)
        lines = [f"{path.name} has a syntax error, so it cannot run: {where}: {type(e).__name__}: {e.msg}"]
        if e.text and e.text.strip():
            text = e.text.rstrip("\n")
            lines.append("    " + text.strip())
            if e.offset and e.offset > 0:
                lead = len(text) - len(text.lstrip())
                lines.append("    " + " " * max(0, e.offset - 1 - lead) + "^")
        lines.append("Fix it and run again.")
        return "\n".join(lines)
    except (ValueError, UnicodeDecodeError) as e:  # null bytes, not text in its encoding: not Python source
        return f"{path} is not a Python script ({e}): give the .py training script"
    except OSError as e:
        return f"cannot read {path}: {e.strerror or e}"
    return None


def notebook_problem(script: str | os.PathLike) -> str | None:
    """A Jupyter notebook is JSON, not Python: say how to run it under ampdoctor instead."""
    if Path(script).suffix.lower() != ".ipynb":
        return None
    return (f"{script} is a Jupyter notebook, not a Python script: export it to one "
            f"(`jupyter nbconvert --to script {shlex.quote(str(script))}`) and give the .py, or call `ampdoctor.watch(model)` "
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
    children = _ChildWatch()
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    saved_main = sys.modules.get("__main__")
    sys.argv = [str(path), *args]
    sys.path.insert(0, str(path.parent))
    real_exit, pid = os._exit, os.getpid()
    turned_off: list[int] | None = None  # (bisect's autocast-off control: the regions it turned off)
    done: list[ScriptResult] = []

    def finish(status: str, code: int, err: str | None = None, tb: str | None = None,
               stop_reason: str | None = None, decision: Any = None) -> ScriptResult:
        if done:
            return done[0]
        os._exit = real_exit
        children.remove()
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
        if turned_off is not None:  # how many autocast regions the control ran disabled (0: the script has none)
            extra["autocast_turned_off"] = turned_off[0]
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
                                 decision=decision, trained=trained, completed=completed,
                                 children=list(children.started)))
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
    # SIGTERM (what SLURM, Kubernetes and `kill` send) ends the run as Ctrl-C does: report written, exit 143
    # (unless the script sets a handler of its own, which then decides)
    term_prev = None
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        term_prev = signal.signal(signal.SIGTERM, _raise_terminated)
    thread_stop = _ThreadStop()  # --max-steps / a decided trial reached in a thread the script started
    no_autocast = contextlib.ExitStack()
    if config.autocast_off:  # (bisect's control: the script's own code under autocast in FP32 too)
        from .precision import autocast_off
        turned_off = no_autocast.enter_context(autocast_off())
    try:
        runpy.run_path(str(path), run_name="__main__")
        thread_stop.check()
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
    except Terminated:
        status, code, err = "interrupted", 143, "SIGTERM"
    except BaseException as e:  # the user's script failed: keep its cause, not ours
        status, code = "crashed", 1
        err = f"{type(e).__name__}: {e}"
        tb = _user_traceback(e, path)
    finally:
        thread_stop.remove()
        if term_prev is not None and signal.getsignal(signal.SIGTERM) is _raise_terminated:
            signal.signal(signal.SIGTERM, term_prev)
        if os.getpid() != pid:  # a child the script forked (os.fork) ran to the script's end: its end, not the run's
            _end_forked_child(code, tb)
        result = finish(status, code, err, tb, stop_reason, decision)
        no_autocast.close()
    return result


class _ThreadStop:
    """The stop (:class:`StopRun`) raised at a step boundary in a thread the script started: that
    thread ends quietly (no "Exception in thread" traceback of ours), and the main thread stops too
    as soon as it runs Python again (after its ``join()``, say), as a stop in the main thread stops
    the script: through the SIGINT handler, which is ours while the run lasts (a Ctrl-C is still a
    KeyboardInterrupt). Where the script installed a SIGINT handler of its own, or the run is not
    in the main thread, the main thread runs on and the run ends as stopped when the script does."""

    def __init__(self) -> None:
        self.stop: StopRun | None = None
        self._prev_hook = threading.excepthook
        threading.excepthook = self._excepthook
        self._prev_int = None
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._prev_int = signal.signal(signal.SIGINT, self._on_sigint)

    def _excepthook(self, args: Any) -> None:
        if args.exc_type is None or not issubclass(args.exc_type, StopRun):
            return self._prev_hook(args)
        first = self.stop is None
        self.stop = self.stop or args.exc_value
        if first and signal.getsignal(signal.SIGINT) == self._on_sigint:
            import _thread
            _thread.interrupt_main()

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self.stop is not None:
            raise StopRun(self.stop.reason, self.stop.decision)
        signal.default_int_handler(signum, frame)

    def check(self) -> None:
        """The script ended: as stopped, if a thread of it was."""
        if self.stop is not None:
            raise StopRun(self.stop.reason, self.stop.decision)

    def remove(self) -> None:
        if threading.excepthook == self._excepthook:
            threading.excepthook = self._prev_hook
        if self._prev_int is not None and signal.getsignal(signal.SIGINT) == self._on_sigint:
            signal.signal(signal.SIGINT, self._prev_int)


class Terminated(BaseException):
    """SIGTERM arrived while ``run`` ran the script (see :func:`_raise_terminated`)."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated()


def _end_forked_child(code: int, tb: str | None) -> None:
    """End a process the script forked with ``os.fork()`` that came back out of the script (``sys.exit``,
    an exception, the script's last line) as Python would end it, and before the run's own end (its
    report, its exit status) runs here a second time: the script's traceback, the exit handlers, then
    the exit. The run's session left this process at the fork (``session._forked``)."""
    import atexit

    try:
        if tb:
            sys.stderr.write(tb)
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


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
