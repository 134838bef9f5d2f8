"""``ampdoctor.bisect(train_fn)``: bisection of a Python callable, for notebooks.

Each trial calls ``train_fn()`` in this process under a fresh session (RNGs reseeded, the
model watched automatically, the trial's modules forced to FP32), so ``train_fn`` must build
its own model and optimizer on every call. The result is the same dict as ``ampdoctor bisect
--json`` writes. In-process trials cannot be killed: a trial that hangs hangs the call.
"""

from __future__ import annotations

import json
import logging
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..config import RunConfig
from ..session import Session, StopRun, _set_current
from .driver import BisectOptions, run_bisect
from .trials import Trial, TrialRunner

log = logging.getLogger(__name__)


class InProcessRunner(TrialRunner):
    """Trials that call ``train_fn()`` here instead of starting a subprocess."""

    def __init__(self, train_fn: Callable[[], Any], out: Path, *, seed: int = 0, **kw: Any):
        super().__init__(None, [], out, **kw)
        self.train_fn = train_fn
        self.seed = seed

    def run(self, name: str, fp32: Sequence[str], *, pass_after: int | None, all_modules: bool = False,
            probe: Sequence[str] = (), gpu: int | None = None, lite: bool = False, oracle: dict | None = None,
            timeout: float | None = None, autocast_off: bool = False) -> Trial:  # (in-process: not stopped on time)
        import contextlib

        import numpy as np
        import torch

        from ..runner import _attach_probe, _write_probe

        index = len(self.trials)
        folder = self.out / "trials" / f"{index:02d}-{name}"
        folder.mkdir(parents=True, exist_ok=True)
        cfg: RunConfig = self.config(fp32, trace=folder / "trace.sqlite", pass_after=pass_after,
                                     all_modules=all_modules, probe=probe, lite=lite, oracle=oracle,
                                     autocast_off=autocast_off)
        (folder / "config.json").write_text(cfg.to_env())
        random.seed(self.seed)
        np.random.seed(self.seed)
        torch.manual_seed(self.seed)
        session = Session(cfg, owned=True)
        _set_current(session)
        from ..autowatch import AutoWatch

        auto = AutoWatch(session)
        probes: list[Any] = []
        if cfg.probe:
            session.on_attach.append(lambda w: _attach_probe(w, cfg, probes))
        t0 = time.monotonic()
        status, err, decision, code = "finished", None, None, 0
        no_autocast = contextlib.ExitStack()
        if autocast_off:
            from ..precision import autocast_off as _off
            turned_off = no_autocast.enter_context(_off())
        try:
            self.train_fn()
        except StopRun as e:
            status, decision = "stopped", e.decision
        except SystemExit as e:  # sys.exit() in a function made from a script: as a trial process's exit
            if e.code not in (None, 0):
                status, code = "exited", e.code if isinstance(e.code, int) else 1
                err = f"sys.exit({e.code!r})"
        except Exception as e:  # the user's function failed: an error trial, not ours
            status, err, code = "crashed", f"{type(e).__name__}: {e}", 1
        finally:
            auto.remove()
            for p in probes:
                _write_probe(session, p)
            trained = session.step > 0 or session.optimizer_steps > 0
            steps = session.step
            extra = {"exit_code": code} if code else {}
            if autocast_off:
                extra["autocast_turned_off"] = turned_off[0]
            session.close(status=status if status in ("crashed", "exited") else "finished", **extra)
            no_autocast.close()
            decision = decision or session.decision
        data = {"status": status, "exit_code": code, "error": err, "steps": steps, "trained": trained,
                "decision": None if decision is None else {"outcome": decision.outcome, "step": decision.step,
                                                           "reason": decision.reason}}
        (folder / "result.json").write_text(json.dumps(data))
        handle = {"folder": folder, "fp32": list(fp32), "name": name, "index": index, "autocast": not autocast_off}
        trial = self._classify(handle, 0, False, time.monotonic() - t0)
        self.trials.append(trial)
        return trial

    def run_many(self, specs, *, pass_after, jobs, gpus=0, lite=False):
        return [self.run(n, f, lite=lite, **{"pass_after": pass_after, **(rest[0] if rest else {})})
                for n, f, *rest in specs]


def bisect(train_fn: Callable[[], Any], *, format: str = "auto", out: str | Path | None = None,
           max_steps: int | None = None, margin: int | None = None, repeat: int = 1, drill: bool = True,
           seed: int = 0, oracle: Any = None, progress: Callable[[str, dict], None] | None = None) -> dict:
    """Find the modules whose FP32 cast stops ``train_fn()`` from breaking; returns the bisect
    result dict (``verdict``, ``culprits``, ``failure``, ``ops``, ``trials``, ``advice``)."""
    if not callable(train_fn) or isinstance(train_fn, torch.nn.Module):
        what = "a model" if isinstance(train_fn, torch.nn.Module) else type(train_fn).__name__
        raise TypeError(f"ampdoctor.bisect expects a callable that builds a model and trains it (each trial "
                        f"calls it afresh), got {what}")
    from ..runfolder import FolderHeld, lock

    out_dir = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="ampdoctor-bisect-"))
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"ampdoctor.bisect: out={os.fspath(out)!r} is a file; pass a folder (made if missing)")
    from ..trace import trace_problem
    problem = trace_problem(out_dir / "trace.sqlite")  # where the baseline's trace is kept at the end
    if problem:
        raise ValueError(f"ampdoctor.bisect: {problem}: pass another out=, or remove it")
    try:
        release = lock(out_dir, "bisect")
    except FolderHeld as e:
        raise RuntimeError(f"ampdoctor.bisect: {e}; pass another out=, or wait until it ends") from None
    except OSError as e:
        raise ValueError(f"ampdoctor.bisect: cannot make the folder out={os.fspath(out)!r}: {e.strerror or e}") from None
    try:
        return _bisect_in(train_fn, out_dir, format=format, max_steps=max_steps, margin=margin, repeat=repeat,
                          drill=drill, seed=seed, oracle=oracle, progress=progress)
    finally:
        release()


def _bisect_in(train_fn: Callable[[], Any], out_dir: Path, *, format: str, max_steps: int | None,
               margin: int | None, repeat: int, drill: bool, seed: int, oracle: Any,
               progress: Callable[[str, dict], None] | None) -> dict:
    from ..oracle import OracleConfig

    opts = BisectOptions(fmt=format, oracle=oracle or OracleConfig(), max_steps=max_steps, margin=margin,
                         repeat=repeat, drill=drill)
    runner = InProcessRunner(train_fn, out_dir, seed=seed, fmt=format, oracle=opts.oracle.to_dict(),
                             max_steps=max_steps)
    from .driver import _clean, keep_baseline_trace
    saved = _rng_states()
    try:
        res = _clean(run_bisect(None, [], out_dir, opts, progress=progress, runner=runner))  # as bisect.json: no Inf/NaN
    finally:
        _restore_rng(saved)  # the trials reseed the global RNGs: the caller gets back the state it had
    try:  # the run folder as the CLI leaves it: `ampdoctor report OUT` shows the baseline with the result
        keep_baseline_trace(out_dir, res)
    except OSError as e:  # the result stands without it
        log.warning("ampdoctor: could not copy the baseline trace into %s: %s", out_dir, e)
    return res


def _rng_states() -> tuple:
    """The global RNG states a trial reseeds: Python's, NumPy's, torch's CPU generator and those of
    the CUDA devices already initialised (reading them does not initialise CUDA)."""
    import numpy as np

    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def _restore_rng(saved: tuple) -> None:
    import numpy as np

    py, npy, cpu, cuda = saved
    random.setstate(py)
    np.random.set_state(npy)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
