"""Running trials: one fresh subprocess per trial, classified pass/fail/error/timeout.

A trial re-runs the user's script (``python -m ampdoctor._trial``) with some modules forced
to FP32; the oracle inside the trial stops it as soon as it is decided. Exceptions, non-zero
exits and timeouts are ``error``/``timeout`` (git bisect's *skip*), never ``fail`` -- except
a script that raises *after* its loss went non-finite (``if loss.isnan(): raise``), which is
the numerical failure it reports.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from ..config import RunConfig
from ..launch import RESULT_PATTERN
from ..oracle import trailing_nonfinite_start
from ..trace import TraceReader

log = logging.getLogger(__name__)


LITE_EVERY = 1_000_000  # "every" of a search trial: full statistics only at step 0 and after a NaN loss
STOP_GRACE = 2.0  # seconds a trial ended by an interrupt has between SIGTERM and SIGKILL


@dataclass
class Trial:
    index: int
    name: str
    fp32: list[str]
    outcome: str                 # pass | fail | error | timeout
    step: int | None = None      # failing step (fail) or steps run
    reason: str | None = None
    seconds: float = 0.0
    folder: str = ""
    error: str | None = None
    steps: int = 0
    extra: dict = field(default_factory=dict)

    autocast: bool = True        # False: the control with every autocast region of the script off

    def to_contract(self) -> dict:
        out = {"fp32": list(self.fp32), "outcome": self.outcome, "step": self.step, "seconds": round(self.seconds, 3)}
        if not self.autocast:
            out["autocast"] = False
        if self.name == "confirm":  # the culprits found, run as far as the all-FP32 control (driver._confirm)
            out["confirm"] = True
        return out


class TrialRunner:
    """Runs trials of one script into ``out/trials/NN-name/`` and keeps their results."""

    def __init__(self, script: str | None, args: Sequence[str], out: Path, *, fmt: str = "fp16", oracle: dict | None = None,
                 timeout: float | None = None, max_steps: int | None = None, python: str | None = None,
                 env: dict | None = None, fork: bool = False, nproc: int = 1):
        self.script = str(Path(script).resolve()) if script is not None else ""
        self.args = list(args)
        self.out = Path(out)
        self.fmt = fmt
        self.oracle = oracle or {}
        self.timeout = timeout
        self.max_steps = max_steps
        self.python = python or sys.executable
        self.env = dict(env or {})
        self.trials: list[Trial] = []
        self.reference: dict | None = None  # FP32 control losses, for the divergence criterion
        self.nproc = max(1, int(nproc))
        self.fork = fork and self.nproc == 1 and fork_ok()
        if self.fork:
            _preload_for_forks()

    def config(self, fp32: Sequence[str], *, trace: Path, pass_after: int | None, all_modules: bool = False,
               probe: Sequence[str] = (), lite: bool = False, oracle: dict | None = None,
               autocast_off: bool = False) -> RunConfig:
        """``oracle``: settings of this trial's oracle that differ from the runner's (the all-FP32 control's)."""
        # lite: a search trial needs only what the oracle reads (loss, scale, skipped), not per-layer
        # statistics: record the first step in full, then only the steps after a non-finite loss
        every = LITE_EVERY if lite else 1
        return RunConfig(trace=str(trace), format=self.fmt, every=every, all_modules=all_modules, max_steps=self.max_steps,
                         force_fp32=list(fp32), oracle={**self.oracle, **(oracle or {})}, pass_after=pass_after,
                         probe=list(probe), reference_losses=self.reference, autocast_off=autocast_off)

    def start(self, name: str, fp32: Sequence[str], *, pass_after: int | None, all_modules: bool = False,
              probe: Sequence[str] = (), gpu: int | None = None, lite: bool = False, oracle: dict | None = None,
              timeout: float | None = None, autocast_off: bool = False) -> dict:
        """Launch a trial; returns a handle for :meth:`wait`. ``timeout``: this trial's, instead of the runner's."""
        index = len(self.trials) + len(getattr(self, "_running", []))
        folder = self.out / "trials" / f"{index:02d}-{name}"
        folder.mkdir(parents=True, exist_ok=True)
        cfg = self.config(fp32, trace=folder / "trace.sqlite", pass_after=pass_after, all_modules=all_modules, probe=probe,
                          lite=lite, oracle=oracle, autocast_off=autocast_off)
        (folder / "config.json").write_text(cfg.to_env())
        env = dict(os.environ, **self.env)
        env["AMPDOCTOR_CONFIG"] = cfg.to_env()
        env["AMPDOCTOR_TRIAL_RESULT"] = str(folder / ("result.json" if self.nproc == 1 else RESULT_PATTERN))
        env["PYTHONUNBUFFERED"] = "1"
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        stdout = open(folder / "stdout.txt", "w")
        stderr = open(folder / "stderr.txt", "w")
        cmd = [self.python, "-m", "ampdoctor._trial", self.script, *self.args]
        if self.nproc > 1:
            from ..launch import torchrun_command
            cmd = torchrun_command(self.nproc, self.script, self.args, self.python)
        t0 = time.monotonic()
        with _interrupts_held():  # a trial that exists is registered before an interrupt can end bisect
            if self.fork and gpu is None:
                proc = _fork_trial(self.script, self.args, env, stdout, stderr)
            else:
                # stdin: none (trials run side by side and again: a prompt would block one unseen, and the first
                # trial would take piped input from the others)
                proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL,
                                        stdout=stdout, stderr=stderr, env=env, cwd=os.getcwd(), start_new_session=True)
            handle = {"proc": proc, "t0": t0, "folder": folder, "fp32": list(fp32), "name": name, "index": index,
                      "autocast": not autocast_off,
                      "files": (stdout, stderr), "timeout": self.timeout if timeout is None else timeout}
            self._running = getattr(self, "_running", []) + [handle]
        return handle

    def wait(self, handle: dict) -> Trial:
        proc = handle["proc"]
        timed_out = False
        try:
            limit = handle["timeout"]
            remaining = None if limit is None else max(1.0, limit - (time.monotonic() - handle["t0"]))
            proc.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
        seconds = time.monotonic() - handle["t0"]
        for f in handle["files"]:
            f.close()
        self._running = [h for h in self._running if h is not handle]
        trial = self._classify(handle, proc.returncode, timed_out, seconds)
        self.trials.append(trial)
        (handle["folder"] / "outcome.json").write_text(json.dumps(trial.__dict__, default=str, indent=1))
        return trial

    def stop_all(self, grace: float = STOP_GRACE) -> None:
        """End every running trial and whatever it started (its trace writer, torchrun's ranks): each
        trial's process group gets SIGTERM, then SIGKILL once ``grace`` seconds have passed (or at
        once when a second interrupt cuts the wait short). The trials are not recorded."""
        running, self._running = list(getattr(self, "_running", [])), []
        for h in running:
            _signal_group(h["proc"], signal.SIGTERM)
        try:
            deadline = time.monotonic() + grace
            waiting = list(running)
            while waiting and time.monotonic() < deadline:
                waiting = [h for h in waiting if not _group_gone(h["proc"])]
                if waiting:
                    time.sleep(0.05)
        finally:
            for h in running:
                _kill_group(h["proc"])
                for f in h["files"]:
                    f.close()

    def run(self, name: str, fp32: Sequence[str], *, pass_after: int | None, **kw: Any) -> Trial:
        return self.wait(self.start(name, fp32, pass_after=pass_after, **kw))

    def run_many(self, specs: list[tuple], *, pass_after: int | None, jobs: int,
                 gpus: int = 0, lite: bool = False) -> list[Trial]:
        """Run several independent trials, ``jobs`` at a time (one GPU each when ``gpus``). A spec is
        ``(name, fp32)`` or ``(name, fp32, kw)``, ``kw`` overriding ``pass_after`` or giving ``oracle``."""
        results: list[Trial | None] = [None] * len(specs)
        pending = list(enumerate(specs))
        running: list[tuple[int, dict]] = []
        slot = 0
        while pending or running:
            while pending and len(running) < max(1, jobs):
                i, (name, fp32, *rest) = pending.pop(0)
                kw = {"pass_after": pass_after, **(rest[0] if rest else {})}
                gpu = (slot % gpus) if gpus else None
                slot += 1
                running.append((i, self.start(name, fp32, gpu=gpu, lite=lite, **kw)))
            i, h = running.pop(0)
            results[i] = self.wait(h)
        return [r for r in results if r is not None]

    # -- classification --------------------------------------------------------------------
    def _classify(self, handle: dict, returncode: int | None, timed_out: bool, seconds: float) -> Trial:
        folder = handle["folder"]
        base = dict(index=handle["index"], name=handle["name"], fp32=handle["fp32"], seconds=seconds, folder=str(folder),
                    autocast=handle.get("autocast", True))
        result_file = folder / "result.json"
        if not result_file.exists() and (folder / "result.rank0.json").exists():
            result_file = folder / "result.rank0.json"  # under torchrun rank 0 speaks for the run
        elif not result_file.exists():  # rank 0 was stopped by torchrun after another rank decided
            result_file = next((p for p in sorted(folder.glob("result.rank*.json"))
                                if json.loads(p.read_text()).get("status") == "stopped"), result_file)
        data = json.loads(result_file.read_text()) if result_file.exists() else None
        last_loss_bad, steps = _trace_tail(folder / "trace.sqlite")
        if timed_out:
            return Trial(outcome="timeout", error=f"killed after {handle.get('timeout', self.timeout):.0f}s (--timeout)",
                         steps=steps, **base)
        if data is None and returncode == 0 and steps:
            # the script ended the process itself (os._exit(0)) before the trial could write its result:
            # what it trained is in the trace, as for a script that finished
            if last_loss_bad is not None:
                return Trial(outcome="fail", step=last_loss_bad, reason="nonfinite_loss", steps=steps, **base)
            return Trial(outcome="pass", step=steps, steps=steps, **base)
        if data is None:
            why = f"the trial process died (exit status {returncode})"
            if returncode is not None and returncode < 0:
                why += f", killed by signal {-returncode}" + (" (out of memory?)" if -returncode == signal.SIGKILL else "")
            if last_loss_bad:
                return Trial(outcome="fail", step=last_loss_bad, reason="nonfinite_loss", error=why, steps=steps, **base)
            return Trial(outcome="error", error=why + f"; see {folder}/stderr.txt", steps=steps, **base)
        dec = data.get("decision") or {}
        steps = data.get("steps", steps)
        if data["status"] in ("crashed", "exited", "interrupted"):
            err = data.get("error") or f"exit status {data.get('exit_code')}"
            if dec.get("outcome") == "fail":
                return Trial(outcome="fail", step=dec.get("step"), reason=dec.get("reason"), error=err, steps=steps, **base)
            if last_loss_bad is not None:
                return Trial(outcome="fail", step=last_loss_bad, reason="nonfinite_loss", steps=steps,
                             error=f"{err} (raised after the loss became non-finite)", **base)
            if not data.get("traceback"):  # SystemExit (argparse!) and friends: show what the script said
                tail = _tail(folder / "stderr.txt")
                err = f"{err}: {tail}" if tail else err
            return Trial(outcome="error", error=err, steps=steps, extra={"traceback": data.get("traceback")}, **base)
        if not data.get("trained", True) and not (data["status"] == "finished" and last_loss_bad is not None):
            # (a loop that left out every step on a NaN/Inf, `if not loss.isfinite(): continue`, did run: it
            # fails below, at the step its outputs went non-finite)
            return Trial(outcome="error", steps=steps, error="the script never trained (no optimizer.step() or "
                         "GradScaler.update() ran)", **base)
        if dec.get("outcome") == "fail":
            return Trial(outcome="fail", step=dec.get("step"), reason=dec.get("reason"), steps=steps, **base)
        if data["status"] == "finished" and last_loss_bad is not None:
            # the script ended on its own inside a non-finite streak shorter than the oracle's K, or
            # stopped (`break`) on a non-finite loss before backward: broken, as `ampdoctor run` says
            return Trial(outcome="fail", step=last_loss_bad, reason="nonfinite_loss", steps=steps, **base)
        return Trial(outcome="pass", step=steps, steps=steps, **base)


def _tail(path: Path, lines: int = 2) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(t.strip() for t in text[-lines:])


def _trace_tail(path: Path) -> tuple[int | None, int]:
    """(first step of the non-finite streak the run ended in, steps recorded): the last loss was
    non-finite, or the last step's forward outputs held NaN/Inf (a script that raises on a NaN
    loss before calling backward)."""
    if not path.exists():
        return None, 0
    try:
        with TraceReader(path) as r:
            steps = r.steps()
            acts = r.stats(kind="activation")
            meta = r.meta()
    except Exception:
        return None, 0
    if not steps:
        return None, 0
    bad_out = meta.get("last_output_nonfinite_step")
    tail = trailing_nonfinite_start([(s["step"], s["loss"]) for s in steps])
    if bad_out is not None and meta.get("status") in ("crashed", "finished"):
        # raised, or stopped on its own (`if not loss.isfinite(): break`), right after the model's output
        # went NaN/Inf (where a streak of non-finite losses led there, it started the failure)
        return min(int(bad_out), tail if tail is not None else int(bad_out)), len(steps)
    last_step = steps[-1]["step"]
    if tail is not None:
        return tail, len(steps)
    last_acts = [a for a in acts if a["step"] == last_step]
    if any(a["nan"] or a["posinf"] or a["neginf"] for a in last_acts):
        return last_step, len(steps)
    return None, len(steps)


def fork_ok() -> bool:
    """Trials may be forked from this process (saving the ~1.5 s import of torch per trial) when
    that is safe: Linux, torch imported but CUDA never initialised and no GPU visible. On GPU
    machines every trial is a fresh interpreter, so each gets a clean CUDA context. The caller must
    also know that this process never ran a torch op (an OpenMP pool does not survive fork): the
    ``ampdoctor bisect`` command asks for forking, a library caller gets fresh interpreters."""
    if sys.platform != "linux" or os.environ.get("AMPDOCTOR_NO_FORK"):
        return False
    try:
        import torch

        if torch.cuda.is_initialized():
            return False
        return torch.cuda.device_count() == 0
    except Exception:
        return False


def _preload_for_forks() -> None:
    """Import, once in this process, what nearly every training script imports lazily: the first
    ``torch.optim`` optimizer built imports ``torch._dynamo`` (its methods are wrapped to disable
    dynamo), about 1.3-1.7 s of each forked trial's ~1.9 s on a CPU machine. A forked trial then
    starts with it imported, as it starts with torch imported. It starts no thread and touches no
    device; where it fails the trials import it themselves, as before."""
    try:
        import torch._dynamo  # noqa: F401
    except Exception as e:  # pragma: no cover - a torch build without dynamo
        log.debug("ampdoctor bisect: torch._dynamo not preloaded for forked trials (%s: %s)", type(e).__name__, e)


class _ForkedTrial:
    """The bits of ``subprocess.Popen`` that :meth:`TrialRunner.wait` uses, for a forked child."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.002
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("ampdoctor trial", timeout)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return self.returncode  # type: ignore[return-value]

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _fork_trial(script: str, args: list[str], env: dict, stdout: Any, stderr: Any) -> _ForkedTrial:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return _ForkedTrial(pid)
    code = 70
    try:  # the child: a fresh session, its own output files, the trial's environment
        os.setsid()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's (bisect's CLI raises on SIGTERM)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        null = os.open(os.devnull, os.O_RDONLY)  # no stdin, as a trial started fresh has none (see run)
        os.dup2(null, 0)
        os.close(null)
        os.dup2(stdout.fileno(), 1)
        os.dup2(stderr.fileno(), 2)
        os.environ.clear()
        os.environ.update(env)
        from .. import _trial

        code = _trial.main([script, *args])
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM (the bisect CLI raises it as an interrupt) that arrive inside wait until the
    block ends, then act as they would have. Starting a trial inside it, an interrupt cannot end bisect
    between the child's creation (inside Popen or the fork) and its registration among the running
    trials, which :meth:`TrialRunner.stop_all` ends: else the trial, in a session of its own that the
    terminal's Ctrl-C does not reach, outlives bisect. Only Python-level handlers are held (the main
    thread's; elsewhere no interrupt is raised). Blocking the signals (``pthread_sigmask``) would not
    do: the children would inherit the mask, and another thread may take the signal."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[tuple[int, Any]] = []
    state = {"open": True}
    previous: dict[int, Any] = {}

    def hold(signum: int, frame: Any) -> None:
        if state["open"]:
            held.append((signum, frame))
        else:  # (left in place when an interrupt cut the restoring short: the handler it stands for)
            previous[signum](signum, frame)

    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            handler = signal.getsignal(sig)
            if callable(handler):  # (SIG_DFL, SIG_IGN or a handler not set from Python: none to hold)
                previous[sig] = handler
                signal.signal(sig, hold)
        yield
    finally:
        state["open"] = False  # from here on ``hold`` passes a signal on: none is lost
        try:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        finally:
            if held:
                signum, frame = held[0]
                previous[signum](signum, frame)


def _kill_group(proc: Any) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        if proc.poll() is None:  # (a reaped trial's pid may be another process's by now)
            proc.kill()
    proc.wait()


def _signal_group(proc: Any, sig: int) -> None:
    """``sig`` to the trial's process group (a trial leads its own session: its pid is the group's
    id, kept while any process of the group lives), or to the trial alone before it made one."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        if proc.poll() is None:
            try:
                os.kill(proc.pid, sig)
            except ProcessLookupError:
                pass
    except PermissionError:
        pass


def _group_gone(proc: Any) -> bool:
    """The trial exited (reaped here) and no process of its group is left."""
    if proc.poll() is None:
        return False
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
