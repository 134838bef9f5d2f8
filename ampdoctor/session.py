"""The recording session of one process: step boundaries, the device buffers of statistics,
the single host read per recorded step, first-non-finite attribution and the trace writer.

Every :class:`~ampdoctor.watch.Watch` in a process feeds one session. Hooks only append device
tensors here; :meth:`Session.end_step` reads them all with one host transfer.
"""

from __future__ import annotations

import atexit
import collections
import functools
import logging
import math
import operator
import os
import shlex
import socket
import sys
import tempfile
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from . import rank_boot
from . import stats as _stats
from .attribution import Attribution, bad_rows
from .config import RunConfig
from .formats import AUTO, READINESS_WHY, Format, detect_format, get_format
from .hostcopy import HostCopy as _HostCopy
from .rows import RowPolicy, StepRows
from .steps import StepTracker, closure_given
from .trace import TraceWriter

log = logging.getLogger(__name__)
_get_ident = threading.get_ident
_weakref = weakref.ref

_lid_name = operator.itemgetter(0, 1)  # (lid, name) of a parameter entry
_dtype_of = operator.attrgetter("dtype")
_layout_of = operator.attrgetter("layout")
_strided = torch.strided
_numel = torch.Tensor.numel

KINDS = ("activation", "gradient", "weight", "weight_grad")
_CALL_KINDS = ("activation", "gradient")  # rows numbered by the module's call in the step
_MAX_ROUND = 16  # units learnt for a round at most (see Session._unit_ends)
DETAIL_AFTER_ANOMALY = 3  # with every=N, record this many steps in full after a non-finite loss


def _bootstrapping_child() -> bool:
    """Whether this process is a spawned or forkserver ``multiprocessing`` child importing the parent's
    main module (``__mp_main__``) before it runs its target: code at the script's top level runs again
    here."""
    mp = sys.modules.get("multiprocessing")
    try:
        return mp is not None and bool(getattr(mp.current_process(), "_inheriting", False))
    except Exception:  # pragma: no cover - not the multiprocessing we know
        return False


class StopRun(BaseException):
    """Raised from a step boundary to end the user's script early (max steps, or a trial that is
    decided). A BaseException so that the script's ``except Exception`` does not swallow it."""

    def __init__(self, reason: str, decision: Any = None):
        super().__init__(reason)
        self.reason = reason
        self.decision = decision


@dataclass
class _Layer:
    id: int
    name: str
    type: str
    is_leaf: bool
    parent: int | None
    ord: int | None = None
    notes: set = field(default_factory=set)


def _shown_name(layer: _Layer) -> str:
    """A layer's name as a note shows it: the model itself (named "", or a second model's bare prefix
    ``Class:``, ``Class#2:``) as ``(model) Class``, ``(model) Class#2``."""
    if not layer.name:
        return f"(model) {layer.type}"
    return f"(model) {layer.name[:-1]}" if layer.name.endswith(":") else layer.name


# what a flag-only check covers, by phase (see Session._stale_row)
_STALE_WHAT = {"in": "its input", "out": "its output", "gin": "the gradient of its input",
               "gout": "the gradient of its output"}


def _stepped_without_grads(optimizer: Any) -> bool:
    """Whether none of ``optimizer``'s parameters holds a gradient, some of them requiring one (stops
    at the first gradient: one parameter looked at on a normal step). Never raises."""
    trains = False
    try:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    return False
                trains = trains or p.requires_grad
    except Exception:  # pragma: no cover - an optimizer without torch's param_groups: not ours to judge
        return False
    return trains


def _rank() -> int:
    for var in ("RANK", "LOCAL_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


DEFER_HOST_READ = os.environ.get("AMPDOCTOR_DEFER_READ", "1") != "0"  # see Session._flush_soon


# dtypes summed in their own dtype by Session._params_screen (fp32's range or more: a sum of finite weights
# overflows only past 3.4e38; on the CPU bf16 -> fp32 costs 7x the sum); fp16 (and fp8) sum in fp32
_NATIVE_SUM = (torch.float32, torch.bfloat16, torch.float64)
_NAN, _POSINF, _NEGINF = (_stats.FIELDS.index(k) for k in ("nan", "posinf", "neginf"))


def _grads_held(row_meta: list, host_rows: np.ndarray) -> str | None:
    """What a recorded step's gradient rows (activation and weight gradients) held, for the oracle:
    ``"inf"`` (an Inf), else ``"nan"``, else ``"finite"``; ``None`` without such rows."""
    idx = [i for i, m in enumerate(row_meta) if m[1] in ("gradient", "weight_grad")]
    if not idx:
        return None
    g = host_rows[idx]
    if (g[:, [_POSINF, _NEGINF]] != 0).any():
        return "inf"
    return "nan" if (g[:, _NAN] != 0).any() else "finite"


def _on_host(scalars: dict) -> bool:
    """A step's loss, scale and skip flag are all CPU tensors (or none): reading them costs no sync."""
    return all(v is None or v.device.type == "cpu" for v in (scalars["loss"], scalars["scale"], scalars["skipped"]))


def _training_thread_only(method: Any) -> Any:
    """A step tracker's report (backward, optimizer, GradScaler) from a thread other than the one whose
    training the session records is left out (see :meth:`Session.claim_thread`)."""
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self._owner is not None and _get_ident() != self._owner:
            return None
        return method(self, *args, **kwargs)

    return wrapper



def _measured(meta: list, host_rows: np.ndarray) -> tuple[list, np.ndarray]:
    """The rows of the slots that were measured: one that a failed measurement (or one a Ctrl-C cut short,
    the step then written as the run ends) never filled holds NaN, and gets no row (its NaN counts would
    be cast to int64's minimum)."""
    if not len(meta) or not np.isnan(host_rows[:, 1]).any():
        return meta, host_rows
    keep = ~np.isnan(host_rows[:, 1])
    return [m for m, k in zip(meta, keep.tolist()) if k], host_rows[keep]

class Session:
    """One per process. Created by the first ``watch()`` (or by the CLI runner)."""

    def __init__(self, config: RunConfig | None = None, *, owned: bool = False):
        self.config = config or RunConfig()
        # "auto": fp16 until the first watched forward decides it (resolve_format), before anything is measured
        self._fmt_auto = str(self.config.format).lower() == AUTO
        self._owner: int | None = None  # the thread that trains the watched models (see claim_thread)
        self.foreign_notes: list[str] = []  # notes from other threads, written at the next step's end
        # fp16 for want of autocast or half parameters in the first forward: a later forward of step 0 that
        # shows one before any backward (a shape check's forward came first) still decides (recheck_format)
        self.fmt_defaulted = False
        self.fmt: Format = get_format("fp16" if self._fmt_auto else self.config.format)
        if self.config.every < 1:
            raise ValueError(f"every must be >= 1, got {self.config.every}")
        self.owned = owned  # owned by the CLI runner: stays open when the last watch goes
        ref = _weakref(self)

        def backward_started(grad: torch.Tensor) -> None:  # on the loss: one a recorded step; weakly held (a loss
            s = ref()  # kept past the watch keeps no session alive)
            if s is not None:
                s._queue_backward_flush()

        self._backward_started = backward_started
        self.rank = _rank()
        if not self.config.trace and _bootstrapping_child():
            # a spawned (or forkserver) child re-running the script's top level, as a DataLoader worker
            # does: the watch() found there makes its temporary trace, says where, and starts a writer
            # process only if this process trains (most such processes only load data)
            self.trace_path = None
            self.writer = TraceWriter(None, deferred=self._start_trace)
        else:
            self.trace_path = self._trace_path()
            self.writer = TraceWriter(self.trace_path)
        self.writer.set_meta(
            format=self.fmt.name, every=self.config.every, started=time.time(), status="running",
            argv=list(sys.argv), torch=torch.__version__, rank=self.rank, pid=os.getpid(), host=socket.gethostname(),
            force_fp32=list(self.config.force_fp32), python=sys.version.split()[0],
        )
        self.writer.commit()
        self.tracker = StepTracker(self)
        self._exc_at_start = getattr(sys, "last_value", None)
        self._sys_exit: tuple[Any, int] | None = None  # (the code of the last sys.exit() call, self.step then)
        if not owned:  # a watch never removed still ends its trace properly at exit
            atexit.register(self._at_exit)
        self.watches: list[Any] = []
        self._prefixes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> prefix of its names
        self.on_attach: list[Any] = []  # callbacks(watch): the runner installs the op probe here
        self.on_step: list[Any] = []    # callbacks(new_step) at each step boundary
        self.layers: list[_Layer] = []
        self._layer_by_name: dict[str, _Layer] = {}
        self._exec_counter = 0
        self.step = 0
        self.optimizer_steps = 0
        self.closed = False
        self._oracle = None
        if self.config.oracle is not None:
            from .oracle import Oracle, OracleConfig
            self._oracle = Oracle(OracleConfig.from_dict(self.config.oracle),
                                  reference_losses=self.config.reference_losses)
        self.decision: Any = None
        self._detail_left = 0
        self._closure_losses_from: int | None = None  # len(self._losses) when an optimizer.step(closure) began
        self.attribution = Attribution(self.layers, self.writer)
        self._pending_scalars: list[tuple[int, dict]] = []
        self._param_rows: dict[str, tuple] = {}  # kind -> (signature, row descriptions, kept entries, plan memo)
        self._scaled_loss_active = False  # a GradScaler was seen: skipped steps are its business
        # Where a step ends: at the last *unit* of a round (see _unit_ends). A unit ends at an optimizer's
        # step without a GradScaler, at update() with one; its label: that optimizer's id, or the ids of
        # the optimizers stepped since the last update(). The round is learnt from the first units (the
        # window, set aside part by part until a label repeats), then followed.
        self._round: list | None = None  # the labels of one round, in order, once learnt
        self._round_guessed = False  # (a round of one unit whose optimizers hold every watched parameter)
        self._may_guess = True  # (until such a guess was wrong)
        self._trainable: set[int] = set()  # ids of the watched parameters that required a gradient at watch()
        self._in_step: list = []  # labels of this step's units so far (round known)
        self._window: list[tuple] = []  # (label, the part's rows and scalars): the step's parts while learning
        self._unit_opts: set[int] = set()  # with a GradScaler: optimizers stepped since the last update()
        self._opt_refs: dict[int, Any] = {}  # id -> weakref of the optimizers in labels (alive?)
        self._foreign_opts: dict[int, tuple] = {}  # id -> (weakref, key, holds no watched parameter?) (see _foreign)
        self._own_opt_stepped = False  # an optimizer holding watched parameters has stepped (see _foreign)
        self.last_mode: bool | None = None  # ``.training`` of the last outermost watched call (see eval_call)
        self._train_modes: set[bool] = set()  # ... of those that a backward pass followed
        self._early_foreign = 0  # steps of other models' optimizers before that
        self._any_disjoint = False  # an optimizer holding no watched parameter has stepped
        self._reached = False  # a backward since the last unit ended reached a watched parameter (see _foreign)
        self._unreached: list[torch.Tensor] = []  # kept losses whose graph reached no watched parameter (see _own_losses)
        self._watched_ids: tuple[Any, frozenset] = (None, frozenset())  # (watches, their trainable parameters' ids)
        self._parts_ending = False  # _end_step of a learnt window: its weights were read part by part
        self._parts_opt_steps = 0  # (and the optimizer steps counted where its last part ended)
        self.last_output_nonfinite: tuple[int, Any] | None = None  # (step, device flag), trials only
        self._row_policy = RowPolicy(self.fmt, on_stale=self._stale_row)
        self._bw_task = -2  # the backward pass whose end flushes the batch (see _queue_backward_flush)
        self._deferred: list[tuple] = []  # recorded steps whose host copy is in flight (CUDA)
        # a recorded step that has ended, whose weights' rows and host copy wait for the next backward
        # pass to start (CUDA, see _end_step); at the boundary instead once a script changed its weights there
        self._boundary: tuple | None = None
        self._boundary_now = False
        self._mid_step = False  # writing a deferred step from inside the next one (see on_backward)
        self._late_grads_said = False  # (see _late_weight_grads)
        self._backward_error_said = False  # (see on_backward_error)
        self._no_grad_step_said = False  # (see on_optimizer_step)
        self._stopped: StopRun | None = None  # the StopRun this session raised, once it has (see _caught_stop)
        self._stop_caught = False
        self.trained = False  # a backward pass ran: forwards with gradients disabled are evaluation from now on
        self._prefetched: _HostCopy | None = None
        self._params_gates: dict[torch.device, torch.Tensor] = {}  # CUDA: an open gate for _params_screen's flags
        self._reset_step()

    # -- set-up ----------------------------------------------------------------------------
    def _trace_path(self) -> Path:
        if self.config.trace:
            p = Path(self.config.trace)
        else:
            p = Path(tempfile.mkdtemp(prefix="ampdoctor-")) / "trace.sqlite"
        if self.rank:
            p = p.with_name(f"{p.stem}.rank{self.rank}{p.suffix}")
        if not self.config.trace:  # the user did not choose it: say where it goes (once per session, on
            # stderr: the package's logger has no handler unless the user configures logging)
            print(f"ampdoctor: recording to {p} (w.report(), or `ampdoctor report {shlex.quote(str(p))}`; watch(trace=...) "
                  "chooses the path)", file=sys.stderr)
        return p

    def _start_trace(self) -> Path:
        self.trace_path = self._trace_path()
        return self.trace_path

    def prefix_for(self, root: Any) -> str:
        """How the names of ``root``'s modules start in the trace: "" for the first model watched,
        ``Class:`` for another one alive with it (a GAN's discriminator: ``D:net.2``), so that two
        models' layers are never merged under the same names. A model watched again keeps its prefix."""
        prefix = self._prefixes.get(root)
        if prefix is None:
            taken = set(self._prefixes.values())
            prefix = ""
            if taken:
                base = type(root).__name__
                prefix, k = f"{base}:", 2
                while prefix in taken:
                    prefix, k = f"{base}#{k}:", k + 1
            self._prefixes[root] = prefix
        return prefix

    def attach(self, watch: Any) -> None:
        self.watches.append(watch)
        # (what trains: Lightning's toggle_optimizer turns requires_grad off for the other optimizers' parameters
        # while one steps, see _steps_all)
        self._trainable.update(id(p) for _, _, p in getattr(watch, "_params", ()) if p is not None and p.requires_grad)
        self.tracker.install()
        for cb in list(self.on_attach):
            cb(watch)

    def detach(self, watch: Any, exc: BaseException | None = None) -> None:
        """``exc``: what ended the ``with watch(...)`` block, if it raised (the run's end then says so)."""
        if watch in self.watches:
            self.watches.remove(watch)
        if not self.watches and not self.owned:
            if isinstance(exc, SystemExit):
                self._close_with_exit_code(exc.code)
            elif isinstance(exc, KeyboardInterrupt):
                self.close("interrupted", error="KeyboardInterrupt")
            elif isinstance(exc, Exception):
                self.close("crashed", error=f"{type(exc).__name__}: {exc}")
            else:
                self.close()

    def new_layer(self, name: str, type_: str, is_leaf: bool, parent: int | None) -> int:
        if name in self._layer_by_name:
            return self._layer_by_name[name].id
        layer = _Layer(len(self.layers), name, type_, is_leaf, parent)
        self.layers.append(layer)
        self._layer_by_name[name] = layer
        self.writer.add_layers([(layer.id, name, type_, None, int(is_leaf), parent)])
        return layer.id

    def note_layer(self, lid: int, message: str) -> None:
        """A once-per-layer remark (e.g. "no floating output"): logged and stored as an event."""
        layer = self.layers[lid]
        if message in layer.notes:
            return
        layer.notes.add(message)
        name = _shown_name(layer)
        log.info("ampdoctor: %s: %s", name, message)
        self.writer.add_event(self.step, "note", name, message=message)

    def note(self, message: str, **detail: Any) -> None:
        log.warning("ampdoctor: %s", message)
        self.writer.add_event(self.step, "note", None, message=message, **detail)

    # -- per-step state --------------------------------------------------------------------
    def _reset_step(self) -> None:
        every = self.config.every
        self.recording = (self.step % every == 0) or self._detail_left > 0
        if self._detail_left > 0:
            self._detail_left -= 1
        self.attributing = self.recording and not self.attribution.done(self._scaled_loss_active)
        self._new_rows()
        self._outer_next = False  # the next backward pass seen is an outermost one (see on_backward)
        self._losses: list[torch.Tensor] = []
        self._unreached = []
        self._scaled_outputs: list[tuple[Any, torch.Tensor]] = []  # (weakref to scale()'s result, its loss)
        self._scaled_loss_seen = False
        self._scaler: Any = None
        self._scale_after: torch.Tensor | None = None
        self._skipped: torch.Tensor | None = None
        self._active = False
        self._worked = False  # a backward pass or a scaler.scale() since the boundary (see close)
        self._backward_raised = False  # a backward pass raised this step (see on_backward_error)
        # Before the first backward pass: outermost watched calls so far this step all ran with gradients
        # disabled (a sanity-check validation, a model summary's example forward), and none with them
        # enabled (see outermost_call)
        self._provisional = False
        self._grad_call = False

    def _new_rows(self) -> None:
        """The step's rows, flags and module call counts, empty."""
        self._rows = StepRows(self._row_policy)
        self._row_meta: list[tuple] = self._rows.meta
        self._flags: list[tuple] = []  # per flag, the row slots of the tensors concerned (see flag_slots)
        self._flag_meta: list[tuple] = []
        self._calls: dict[int, int] = {}

    def resolve_format(self, root: Any, final: bool = True) -> None:
        """The format of a session created without one (``"auto"``), from autocast's state or the
        model's dtype (:func:`ampdoctor.formats.detect_format`) where a module of the first watched
        forward starts; written to the trace's metadata. Until one shows autocast on (or fp16/bf16
        parameters) it stays open (``final`` False: a forward wrapped in autocast by accelerate or
        the HF Trainer enters it after the outermost module's hook); the end of that forward
        (``final``) settles it, fp16 if nothing showed. The rows measured meanwhile are measured
        again (:meth:`StepRows.remeasure`); where they cannot be (or a step has ended) the trace
        stays measured against fp16 and says so."""
        try:
            got = detect_format(root, default=final)
        except Exception as e:  # pragma: no cover - never break the user's forward: fp16 stays
            self._fmt_auto = False
            log.info("ampdoctor: could not tell the run's format (%s: %s); measuring against fp16", type(e).__name__, e)
            return
        if got is None:
            return
        self._fmt_auto = False
        name, why = got
        self.fmt_defaulted = why == READINESS_WHY
        if name != self.fmt.name:
            fmt = get_format(name)
            if self.step or (self._rows.n_slots and not self._rows.remeasure(fmt)):
                why += f"; seen after recording began, so the trace stays measured against {self.fmt.name}"
            else:
                self.fmt = fmt
                self._row_policy.fmt = fmt  # (what measures the rows reads it there)
        log.info("ampdoctor: measuring against %s (%s)", self.fmt.name, why)
        self.writer.set_meta(format=self.fmt.name, format_detected=why)
        self.writer.commit()

    def claim_thread(self) -> bool:
        """Whether this thread is the one whose training the session records: the first to run a
        watched model's forward. The hooks are not thread-safe; a watched model run from another
        thread is left alone (:meth:`Watch.go_foreign`), and so are the optimizer, GradScaler and
        backward calls of other threads."""
        t = _get_ident()
        if self._owner is None:
            self._owner = t
        return t == self._owner

    def rows_mark(self) -> tuple:
        """Where this step's rows, flags and call counts are now (see :meth:`drop_rows_since`)."""
        return self._rows, len(self._rows.meta), len(self._flags), dict(self._calls)

    def drop_rows_since(self, mark: tuple) -> None:
        """An outermost watched call that raised: the rows and flags made since ``mark`` go, and the
        call counts are as they were (its slots stay measured, unused). Nothing, if the step's rows
        changed meanwhile (a boundary inside the call)."""
        rows, n_rows, n_flags, calls = mark
        if rows is not self._rows or len(rows.meta) < n_rows or len(self._flags) < n_flags:
            return
        del rows.meta[n_rows:]
        del rows.slots[n_rows:]
        del self._flags[n_flags:]
        del self._flag_meta[n_flags:]
        self._calls.clear()
        self._calls.update(calls)

    def recheck_format(self, root: Any) -> None:
        """An outermost call of step 0, before any backward pass, after the first forward left the format
        at fp16 for want of autocast: one that shows autocast (or half parameters) decides it now, the
        rows so far measured again (a model summary's or shape check's forward came first)."""
        try:
            got = detect_format(root, default=False)
        except Exception:  # pragma: no cover - never break the user's forward
            got = None
        if got is not None:
            self.fmt_defaulted = False
            self._fmt_auto = True
            self.resolve_format(root, final=False)

    def outermost_call(self, grad: bool) -> None:
        """An outermost watched module call starts, before any backward pass has run. Calls with gradients
        disabled are recorded provisionally: evaluation before training (Lightning's sanity-check
        validation, a summary's example forward) when a call with gradients enabled follows in the same
        step (their rows are dropped then, as evaluation is once training has started), an inference-only
        watch or an FP16 readiness check when none does."""
        if grad:
            if self._provisional:
                self._drop_provisional()
            self._grad_call = True
        elif not self._grad_call:
            self._provisional = True

    def _drop_provisional(self) -> None:
        self._new_rows()
        self._active = False
        self._provisional = False

    def mark_order(self, lid: int) -> None:
        """First time a module starts its forward: its place in execution (pre-)order."""
        layer = self.layers[lid]
        if layer.ord is None:
            layer.ord = self._exec_counter
            self._exec_counter += 1
            self.writer.add_layers([(lid, layer.name, layer.type, layer.ord, int(layer.is_leaf), layer.parent)])

    def add_stats(self, lid: int, kind: str, slot: str, call: int, t: torch.Tensor) -> None:
        """Statistics of ``t`` into this step's batch (measured at the next flush point, see
        :mod:`ampdoctor.rows`; no host sync)."""
        if self.closed:
            return
        if kind in ("gradient", "weight_grad"):
            self._queue_backward_flush()
        try:
            n = t.numel()
            self._rows.add_row((lid, kind, slot, call, _dtype_name(t.dtype), n, n * t.element_size()), t,
                               (lid, kind, slot))
        except Exception as e:  # never break the user's training because of a statistic
            self.note_layer(lid, f"could not record {kind} {slot}: {type(e).__name__}: {e}")

    def add_param_rows(self, kind: str, entries: list[tuple[int, str, torch.Tensor]], rows: StepRows | None = None) -> None:
        """Rows of kind ``kind`` ("weight" or "weight_grad") of the tensors ``(lid, name, tensor)``
        as they are now, measured together at once (one launch per device on CUDA): they are alive
        anyway and nothing else asks for them this step. ``rows``: those of a step that has ended
        (its weights, see :meth:`_end_step`), not this step's."""
        if self.closed:
            return
        ts = [e[2] for e in entries]
        layouts = list(map(_layout_of, ts))
        if layouts.count(_strided) != len(layouts) and kind == "weight_grad":
            ts, layouts = self._sparse_values(entries, ts, layouts)
        # the rows' descriptions change only with the entries, dtypes, sizes and layouts (cached:
        # hundreds of parameters a step)
        sig = (list(map(_lid_name, entries)), list(map(_dtype_of, ts)), list(map(_numel, ts)), layouts)
        cached = self._param_rows.get(kind)
        if cached is not None and cached[0] == sig:
            metas, keep, memo = cached[1], cached[2], cached[3]
        else:
            metas, keep, memo = [], [], {}  # memo: the launch plan of these rows (see StepRows.add_now)
            for i, ((lid, pname, _), t) in enumerate(zip(entries, ts)):
                if t.is_floating_point() and t.layout == torch.strided and not t.is_meta:  # (meta: no values)
                    n = t.numel()
                    metas.append((lid, kind, pname, 0, _dtype_name(t.dtype), n, n * t.element_size()))
                    keep.append(i)
            self._param_rows[kind] = (sig, metas, keep, memo)
        if len(keep) != len(ts):
            ts = [ts[i] for i in keep]
        if not ts:
            return
        if rows is None:
            rows = self._rows
            self._active = True
        try:
            rows.add_now(metas, ts, memo)
        except Exception as e:  # pragma: no cover - never break the user's training for a statistic
            log.warning("ampdoctor: could not record %d %s rows: %s: %s", len(ts), kind, type(e).__name__, e)

    def _sparse_values(self, entries: list, ts: list, layouts: list) -> tuple[list, list]:
        """Sparse COO gradients (``nn.Embedding(sparse=True)``, ``EmbeddingBag``) are measured by their
        stored values, duplicate indices summed (``coalesce()``: the values the dense gradient holds
        in the rows the batch touched); their row's ``numel`` is the count of those values. Each such
        parameter gets a note once. Other layouts are left out, as before."""
        ts, layouts = list(ts), list(layouts)
        for i, t in enumerate(ts):
            if layouts[i] is torch.sparse_coo and t.is_floating_point():
                try:
                    ts[i] = t.coalesce()._values()
                except Exception as e:  # pragma: no cover - never break the user's training for a statistic
                    log.warning("ampdoctor: could not read the sparse gradient of %s: %s: %s", entries[i][1],
                                type(e).__name__, e)
                    continue
                layouts[i] = _strided
                lid, pname = entries[i][0], entries[i][1]
                self.note_layer(lid, f"the gradient of {pname} is sparse: its rows measure the values it stores (the "
                                "rows of the weight that the step's inputs touched, repeated indices summed), and "
                                "their element count is those values', not the weight's")
        return ts, layouts

    def add_flag(self, lid: int, call: int, phase: str, flag: tuple | None) -> None:
        """Did this module's inputs/outputs/gradients hold NaN/Inf: the row slots of the tensors
        concerned (:meth:`flag_slots`; no kernel, no sync), read off their rows on the host."""
        if self.closed or flag is None:
            return
        self._flags.append(flag)
        self._flag_meta.append((lid, call, phase))

    def flag_slots(self, lid: int, phase: str, tensors: list, hold: int = 0) -> tuple | None:
        """The non-finite flag of ``tensors``, read off their statistics rows at the step's host
        read (each tensor is measured once per step, whoever asks). No kernel of its own.
        ``hold``: see :meth:`StepRows.slot_of`."""
        if self.closed:
            return None
        if phase in ("gin", "gout"):
            self._queue_backward_flush()
        try:
            return self._rows.flag_slots(tensors, (lid, "flag", phase), hold)
        except Exception as e:  # pragma: no cover - as add_stats
            self.note_layer(lid, f"could not check {phase} for NaN/Inf: {type(e).__name__}: {e}")
            return None

    def flush_rows(self, flags: bool = False) -> None:
        """A flush point: measure the tensors waiting in this step's batch now (launches only).
        Called before a module that works in place runs, and at the end of each backward pass
        (``flags``: the outermost one, a safe flush for held flag-only checks, see
        :meth:`StepRows.flush`)."""
        if self.closed:
            return
        try:
            self._rows.flush(flags=flags)
        except Exception as e:  # pragma: no cover - never break training for a statistic
            log.warning("ampdoctor: could not measure a batch of tensors: %s: %s", type(e).__name__, e)

    def _queue_backward_flush(self) -> None:
        # Once per backward pass: flush when it ends, before anything changes gradients in place; and
        # where the outermost one ends, write a deferred step whose host copy has arrived by then.
        if self.closed or not (self.recording or self._deferred):
            return
        try:
            task = torch._C._current_graph_task_id()
        except Exception:  # pragma: no cover - older torch: the step boundary flushes instead
            return
        if task == -1 or task == self._bw_task:
            return
        self._bw_task = task
        rows = self._rows
        # the first backward pass seen after a loss.backward() called outside any backward is that
        # one's; a nested one (a reentrant checkpoint's, ...) ends before its outer pass does
        outer, self._outer_next = self._outer_next, False
        recording = self.recording

        def at_backward_end() -> None:
            if recording and rows is self._rows:
                for w in self.watches:
                    w.record_weight_grads()
                self.flush_rows(flags=outer)
            if outer:
                for w in self.watches:
                    if w._leaf_hooks:
                        w.drop_leaf_hooks()
                if self._deferred:
                    self._write_arrived()

        torch.autograd.Variable._execution_engine.queue_callback(at_backward_end)

    def _stale_row(self, key: Any) -> None:
        """A tensor waiting to be measured was changed in place first (the loop's ``loss *= n`` on the
        model's output, an in-place op on a gradient): it is missing from this step, and is measured as
        soon as it is made from now on (the policy marked its key)."""
        if len(key) == 3:
            lid, kind, slot = key
            what = "its output" if kind == "activation" else "the gradient of its output"
            if slot != "out":
                what += f" {slot}"
        else:
            lid, phase = key[0][0], key[0][2]
            what = _STALE_WHAT.get(phase, f"its {phase}")
        self.note_layer(lid, f"{what} was changed in place (e.g. `loss *= n` or an in-place op on it) before "
                             f"ampdoctor read it, so step {self.step} has no statistics or NaN/Inf check of it; from "
                             "the next step on it is read as soon as it is made. Nothing to fix in your code.")

    # -- what the step tracker reports -----------------------------------------------------
    def eval_call(self, mod: Any) -> bool:
        """Whether an outermost watched call of ``mod`` is evaluation, not training: after training
        started, with gradients disabled, or with ``mod`` in eval mode (``model.eval()``, a validation
        pass that forgot ``no_grad``) where every call that a backward pass followed was in train mode
        (a model trained in eval mode, to keep its dropout off, is recorded as before)."""
        return self.trained and (not torch.is_grad_enabled() or (not mod.training and self._train_modes == {True}))

    @_training_thread_only
    def on_backward(self, tensors: Any) -> None:
        if self.last_mode is not None:
            self._train_modes.add(self.last_mode)
        if self._provisional and not self.trained:
            self._drop_provisional()  # the watched calls of this step were evaluation; training is not watched
        self._active = self._worked = True
        self.trained = True
        self._outer_next = outer = torch._C._current_graph_task_id() == -1  # not called from inside a backward
        t = tensors[0] if isinstance(tensors, (tuple, list)) and len(tensors) == 1 else tensors
        loss = (isinstance(t, torch.Tensor) and t.numel() == 1 and t.is_floating_point() and not t.is_meta
                and not self._scaled_loss_seen)
        reached = None
        if not self._reached or loss:  # (see _foreign; a loss kept below: see _own_losses)
            reached = self._reach(tensors if isinstance(tensors, (tuple, list)) else (tensors,))
            self._reached = self._reached or reached
        if self._deferred or self._boundary is not None:
            self._write_deferred()
        if self.recording or self._deferred:  # where this backward pass ends: the weight gradients, a deferred write
            roots = tensors if isinstance(tensors, (tuple, list)) else (tensors,)
            for t in roots:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._backward_started)
                    break
            if outer and self.attributing:  # a non-finite loss opens the gate of flag-only checks
                for t in roots:
                    if isinstance(t, torch.Tensor) and t.numel() == 1 and t.is_floating_point():
                        try:
                            self._rows.open_gate_on(t)
                        except Exception as e:  # pragma: no cover - never break training for a statistic
                            log.info("ampdoctor: could not check the loss for NaN/Inf: %s: %s", type(e).__name__, e)
        if loss:
            kept = t.detach().reshape(()).to(torch.float64, copy=True)
            self._losses.append(kept)
            if not reached:
                self._unreached.append(kept)

    @_training_thread_only
    def on_backward_error(self, error: BaseException) -> None:
        """A backward pass raised (the user's code: a custom autograd Function's backward, a shape
        mismatch). Its step's gradients stop where it raised: none are read where the step ends, and
        the first such error is a note and in the trace's metadata (the report's advice says to fix it
        first). Never raises: the user's exception goes on unchanged."""
        try:
            self._backward_raised = True
            if self._backward_error_said or self.closed:
                return
            self._backward_error_said = True
            text = str(error).strip().splitlines()
            first = text[0] if text else ""
            err = f"{type(error).__name__}: {first[:300]}" if first else type(error).__name__
            self.writer.set_meta(backward_error=err, backward_error_step=self.step)
            why = ("autograd's anomaly detection found a NaN there: the rows recorded before it show where it came from"
                   if "nan values" in first.lower() else
                   "this is an error in the code the backward pass ran, not a numerical one")
            self.note(f"backward() raised at step {self.step}: {err}. The gradients recorded for that step are "
                      f"partial (the backward pass stopped where it raised); {why}.")
            self.writer.commit()
        except Exception as e:  # pragma: no cover - never mask the user's own error
            log.warning("ampdoctor: could not record the backward pass's error: %s: %s", type(e).__name__, e)

    @_training_thread_only
    def on_scaled_loss(self, scaler: Any, loss: torch.Tensor, scaled: Any = None) -> None:
        self._active = self._worked = True
        if loss.numel() == 1 and loss.is_floating_point() and not loss.is_meta:
            if not self._scaled_loss_seen:
                self._losses.clear()  # a backward before scale() was not the training loss
            self._scaled_loss_seen = True
            self._scaled_loss_active = True
            kept = loss.detach().reshape(()).to(torch.float64, copy=True)
            self._losses.append(kept)
            if not self._reach((loss,)):
                self._unreached.append(kept)
            if isinstance(scaled, torch.Tensor):  # (see on_autograd_grad)
                self._scaled_outputs.append((_weakref(scaled), kept))
        self._scaler = scaler

    @_training_thread_only
    def on_first_scale(self, scale: float) -> None:
        """A GradScaler's first ``scale()``, at its ``init_scale``: the scale this step's backward runs with
        (its row in the steps table holds the scale after ``update()``, which may have grown already)."""
        if not self.closed:
            self.writer.set_meta(first_scale={"step": self.step, "scale": scale})

    @_training_thread_only
    def on_autograd_grad(self, outputs: Any) -> None:
        """``torch.autograd.grad(scaler.scale(loss), params, create_graph=True)``: the gradients of a
        gradient penalty. That loss is backpropagated later inside ``loss + penalty``, scaled again, so
        this scale() call's loss is not counted in the step's loss."""
        if not self._scaled_outputs:
            return
        outs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        for t in outs:
            for i, (ref, kept) in enumerate(self._scaled_outputs):
                if ref() is t:
                    del self._scaled_outputs[i]
                    self._losses = [x for x in self._losses if x is not kept]
                    break

    @_training_thread_only
    def on_scaler_update(self, scaler: Any, before: torch.Tensor | None, after: torch.Tensor | None) -> None:
        opts = [r() for r in (self._opt_refs.get(k) for k in self._unit_opts) if r is not None]
        if opts and all(o is not None and self._foreign(o) for o in opts):
            self._unit_opts = set()  # another model's GradScaler: neither its scale nor its loss is this run's
            self._drop_foreign_unit()
            return
        self._scaler = scaler
        if after is not None:
            self._scale_after = after.detach().reshape(()).to(torch.float64, copy=True)  # (its own copy: update() changes _scale in place)
            if before is not None:
                self._skipped = (after.reshape(()) < before.reshape(())).to(torch.float64)
        label, self._unit_opts = frozenset(self._unit_opts), set()
        self._unit_ends(label)

    _HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_forward_hooks_always_called",
                   "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs")

    def without_our_hooks(self, state: Any) -> Any:
        """A module's pickled state (``nn.Module.__getstate__``'s copy of its ``__dict__``) with the
        watches' hooks taken out of its hook dicts (copies; the module keeps its own)."""
        if not isinstance(state, dict):
            return state
        ours: set[int] | None = None
        for name in self._HOOK_DICTS:
            d = state.get(name)
            if not d:
                continue
            if ours is None:
                ours = {h.id for w in self.watches for h in w.hook_handles()}
            if not ours.isdisjoint(d):
                state[name] = OrderedDict((k, v) for k, v in d.items() if k not in ours)
        return state

    def on_compile(self) -> None:
        for w in self.watches:
            w.arm()

    @_training_thread_only
    def on_optimizer_step_begin(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        """``optimizer.step(closure)`` (LBFGS, and any optimizer given one) calls the closure, forward
        and backward, as often as it needs: the step's loss is the first call's (what ``step()``
        returns), not the sum of them all (:meth:`on_optimizer_step` drops the later ones)."""
        self._closure_losses_from = None
        if closure_given(args, kwargs):
            self.closure_step_began()

    def closure_step_began(self) -> None:
        """An ``optimizer.step(closure)`` is in progress from here (see :meth:`on_optimizer_step_begin`)."""
        self._closure_losses_from = len(self._losses)

    def _foreign(self, optimizer: Any) -> bool:
        """Whether ``optimizer`` is another model's, trained in the same loop and not through the watched
        one (a second network with its own loss, a probe on detached features): it holds parameters,
        none of them watched, an optimizer of the watched parameters has stepped before, and no backward
        pass since the run's last unit ended reached a watched parameter. Its steps are not this run's
        steps. (A GAN's G, unwatched, whose loss goes through a watched D, is the run's; so is the only
        optimizer of a frozen watched backbone's new head.) The parameters are checked again when their
        count or the watches change; O(groups) a step otherwise."""
        try:
            groups = optimizer.param_groups
            n = sum(len(g.get("params", ())) for g in groups)
        except Exception:  # not a torch optimizer as we know it: taken as the run's
            return False
        live = [w for w in self.watches if not w._removed]
        key = (n, tuple(map(id, live)))
        hit = self._foreign_opts.get(id(optimizer))
        if hit is not None and hit[1] == key and hit[0]() is optimizer:
            disjoint = hit[2]
        else:
            watched = {id(p) for w in live for _, _, p in w._params if p is not None}
            held = {id(p) for g in groups for p in g.get("params", ())}
            disjoint = bool(watched) and bool(held) and watched.isdisjoint(held)
            try:
                self._foreign_opts[id(optimizer)] = (weakref.ref(optimizer), key, disjoint)
            except TypeError:  # pragma: no cover - no weakrefs: checked each time
                pass
        if not disjoint:
            self._own_opt_stepped = True
            return False
        self._any_disjoint = True
        if self._reached:
            return False
        if self._own_opt_stepped:
            return True
        # before the watched model's optimizer first steps (another model trained first in each iteration):
        # its first step is another's if the watched model trains at all; a second one with no optimizer of
        # the watched parameters stepping in between says this one is the run's (a watched model that only
        # runs forward, a teacher)
        return not self._early_foreign and bool(self._trainable_watched())

    def _trainable_watched(self) -> frozenset:
        """The ids of the watched parameters that require a gradient (kept while the watches are)."""
        live = tuple(w for w in self.watches if not w._removed)
        key = tuple((id(w), len(w._params)) for w in live)
        if self._watched_ids[0] != key:
            self._watched_ids = (key, frozenset(id(p) for w in live for _, _, p in w._params
                                                if p is not None and p.requires_grad))
        return self._watched_ids[1]

    def _reach(self, roots: Any) -> bool:
        try:
            return self._reaches_watched(roots)
        except Exception:  # pragma: no cover - taken as the run's
            return True

    def _own_losses(self) -> None:
        """Where a unit ends: with losses of the run's model among them (their graph reached a trainable
        watched parameter), the losses whose graph reached none are another model's (one GradScaler
        shared by both, or both backwards before both steps: ``la.backward(); lb.backward(); ob.step();
        oa.step()``) and not in this step's loss. Where none reached, all are kept (a frozen watched
        model, a watched teacher, a graph our walk cannot see into)."""
        if self._unreached:
            unreached, self._unreached = self._unreached, []
            own = [x for x in self._losses if not any(x is u for u in unreached)]
            if own:
                self._losses = own

    def _reaches_watched(self, roots: Any) -> bool:
        """Whether the autograd graph of a backward's roots has a trainable watched parameter among its
        leaves: breadth first, so the run's own loss finds one within a few nodes (its last layer);
        another model's loss is walked whole. At most 64 nodes while no other model's optimizer has
        been seen (4096 after), and a walk cut short is taken as reaching one (the run's)."""
        watched = self._trainable_watched()
        if not watched:
            return False
        budget = 4096 if self._any_disjoint else 64
        queue = collections.deque(t.grad_fn for t in roots if isinstance(t, torch.Tensor) and t.grad_fn is not None)
        seen: set[int] = set()
        while queue:
            node = queue.popleft()
            if node is None or id(node) in seen:
                continue
            if len(seen) >= budget:
                return True
            seen.add(id(node))
            var = getattr(node, "variable", None)  # (AccumulateGrad: a leaf's gradient)
            if var is not None and id(var) in watched:
                return True
            queue.extend(nxt for nxt, _ in node.next_functions)
        return False

    def _drop_foreign_unit(self) -> None:
        """Another model's optimizer stepped: the losses backpropagated since this run's last unit ended
        were its (they are not this step's loss), and nothing else of it is this run's."""
        self._losses = []
        self._unreached = []
        self._closure_losses_from = None
        self._worked = False  # (a run that ends here has no partial step of its own to write)
        if not self._own_opt_stepped:
            self._early_foreign += 1

    @_training_thread_only
    def on_optimizer_step(self, optimizer: Any) -> None:
        if self._foreign(optimizer):
            if not (self._scaler is not None or self._scaled_loss_seen):
                self._drop_foreign_unit()  # (under a GradScaler, its update() decides: on_scaler_update)
            return
        start, self._closure_losses_from = self._closure_losses_from, None
        if start is not None and len(self._losses) > start + 1:
            del self._losses[start + 1:]
        self.optimizer_steps += 1
        if not self._no_grad_step_said and _stepped_without_grads(optimizer):
            self._no_grad_step_said = True
            self.note(f"{type(optimizer).__name__}.step() ran at step {self.step} while none of its parameters had a "
                      "gradient, so it changed no weight. Did loss.backward() run before it? A zero_grad() between "
                      "backward() and step() clears the gradients too: call it before backward() or after step().")
        if self._scaler is not None or self._scaled_loss_seen:
            self._unit_opts.add(self._opt_id(optimizer))  # with a GradScaler the unit ends at update()
            return
        if not self._active:
            return  # a second optimizer right after the first (one backward for both): same unit
        self._unit_ends(self._opt_id(optimizer))

    @_training_thread_only
    def on_scaler_step(self, scaler: Any, optimizer: Any) -> None:
        """``GradScaler.step(optimizer)``: that optimizer is in this update()'s unit, also when the
        scaler skips its step (no optimizer step runs then)."""
        self._unit_opts.add(self._opt_id(optimizer))

    def _opt_id(self, optimizer: Any) -> int:
        key = id(optimizer)
        ref = self._opt_refs.get(key)
        if ref is None or ref() is not optimizer:
            try:
                self._opt_refs[key] = weakref.ref(optimizer)
            except TypeError:  # pragma: no cover - an object without weakrefs: taken as alive
                self._opt_refs[key] = lambda: True
        return key

    def _alive(self, label: Any) -> bool:
        keys = label if isinstance(label, frozenset) else (label,)
        return all((r := self._opt_refs.get(k)) is not None and r() is not None for k in keys)

    def _unit_ends(self, label: Any) -> None:
        """A unit of work ended: one optimizer's step (no GradScaler), or a GradScaler.update(). A
        step is one *round*: the units between two of the first one (a GAN's D, then G: one step
        each iteration holds both). The round is learnt from the units of the run's first step: each
        is set aside as a part of that step until a unit's label comes again; the parts so far are
        then the step (written now), and the round is their labels. From then on a step ends at the
        round's last unit. A unit whose optimizers hold every watched parameter that trains, seen
        first, is a round of its own at once (one optimizer: no wait); if another optimizer steps
        after all, that unit ends the step and the round is learnt (no such guess again). A unit out of
        the round's order (an optimizer the round did not have) is counted in the step it falls in;
        once a unit comes twice in a step, or the round's last optimizer is gone, the step ends there
        and the round is learnt again. One update() per iteration is a round of one unit."""
        self._reached = False
        self._own_losses()
        rnd = self._round
        if rnd is not None:
            if label == rnd[-1] and label not in self._in_step:
                self._in_step.clear()
                self.end_step()
                return
            if label in self._in_step or not self._alive(rnd[-1]) or self._round_guessed:
                # the order changed (or another optimizer steps, where none was expected): this unit ends
                # the step, and the round is learnt again from the next one; a new optimizer that holds
                # every watched parameter replaced the old one (a restart) and is a round of its own
                if self._round_guessed and self._steps_all(label):
                    self._round = [label]
                else:
                    self._may_guess = self._may_guess and not self._round_guessed  # (that guess was wrong)
                    self._round, self._round_guessed = None, False
                self._in_step.clear()
                self.end_step()
                return
            self._in_step.append(label)
            return
        labels = [part[0] for part in self._window]
        if not labels and self._may_guess and self._steps_all(label):  # (the common case: one optimizer for all)
            self._round, self._round_guessed = [label], True
            self.end_step()
            return
        if label not in labels:
            if labels and (len(labels) >= _MAX_ROUND or not self._alive(labels[0]) or self._steps_all(label)):
                # no repeat in _MAX_ROUND units, the first optimizer is gone, or one that holds every watched
                # parameter steps (a new one; the old one kept but unused): the parts so far are a step, and
                # this unit starts learning again
                self._end_window()
            self._set_part_aside(label)
            return
        self._round, self._round_guessed = labels, False
        self._end_window()
        if label == labels[-1]:
            self.end_step()
        else:
            self._in_step.append(label)

    def _steps_all(self, label: Any) -> bool:
        """Whether the optimizers of ``label`` hold every watched parameter that requires a gradient
        (or did at ``watch()``): then no other optimizer is expected (see :meth:`_unit_ends`).
        O(parameters), while a round is learnt only."""
        held: set[int] = set()
        for key in label if isinstance(label, frozenset) else (label,):
            opt = self._opt_refs[key]() if key in self._opt_refs else None
            for group in getattr(opt, "param_groups", None) or ():
                held.update(map(id, group.get("params", ())))
        if not held:
            return False
        trainable = self._trainable
        return all(p is None or id(p) in held or not (p.requires_grad or id(p) in trainable)
                   for w in self.watches if not w._removed for _, _, p in w._params)

    def _set_part_aside(self, label: Any) -> None:
        """Learning the round: this unit's rows (finished, with the weights as they are now) and
        scalars are kept aside as a part of the step; the next unit starts with empty rows."""
        for w in list(self.watches):
            if self.recording:
                if not w.wgrad_rows:
                    self._late_weight_grads(w)
                w.record_weights()
            w.wgrad_rows = False
        self._rows.finish()
        self._window.append((label, self._rows, self._flags, self._flag_meta, self._calls, self._losses,
                             self._scale_after, self._skipped, self.recording, self.optimizer_steps))
        self._new_rows()
        self._losses = []
        self._scale_after = self._skipped = None
        self._active = self._worked = False

    def _end_window(self) -> None:
        """The parts set aside are one step: those before the last are written now under its number
        (their call numbers after those of the parts before them; their weight rows left out, as the
        last part's show the weights where the step ended), the last one ends the step as usual. The
        unit in progress goes on as the next step (dropped rows if that step is not recorded)."""
        window, self._window = self._window, []
        if not window:
            return
        live = (self._rows, self._row_meta, self._flags, self._flag_meta, self._calls, self._losses,
                self._scale_after, self._skipped, self._active, self.recording)
        scaled = (self._scaled_loss_seen, self._scaler, self._scaled_outputs, self._worked)
        offsets: dict[int, int] = {}
        losses: list = []
        skipped = scale_after = None
        for i, (_, rows, flags, flag_meta, calls, part_losses, part_scale, part_skipped, recorded, _) in enumerate(window):
            last = i == len(window) - 1
            if offsets:
                rows.meta[:] = [(m[0], m[1], m[2], m[3] + offsets.get(m[0], 0), *m[4:]) if m[1] in _CALL_KINDS else m
                                for m in rows.meta]
                flag_meta = [(m[0], m[1] + offsets.get(m[0], 0), *m[2:]) for m in flag_meta]
            if not last and recorded and rows.meta:
                self._write_part(rows, flags, flag_meta)
            for lid, n in calls.items():
                offsets[lid] = offsets.get(lid, 0) + n
            losses.extend(part_losses)
            scale_after = part_scale if part_scale is not None else scale_after
            if part_skipped is not None:
                skipped = part_skipped if skipped is None else torch.maximum(skipped, part_skipped)
        _, rows, flags, flag_meta, calls, _, _, _, recorded, self._parts_opt_steps = window[-1]
        self._rows, self._row_meta, self._flags, self._flag_meta = rows, rows.meta, flags, flag_meta
        self._calls = {lid: n for lid, n in offsets.items()}
        self._losses, self._scale_after, self._skipped = losses, scale_after, skipped
        self.recording = recorded
        self._parts_ending = True
        try:
            self.end_step()
        finally:
            self._parts_ending = False
        rows, row_meta, flags, flag_meta, calls, part_losses, part_scale, part_skipped, active, recorded = live
        if self.recording and recorded:
            self._rows, self._row_meta, self._flags, self._flag_meta, self._calls = rows, row_meta, flags, flag_meta, calls
        self._losses, self._scale_after, self._skipped = part_losses, part_scale, part_skipped
        self._scaled_loss_seen, self._scaler, self._scaled_outputs, self._worked = scaled
        self._active = active or bool(part_losses)

    def _write_part(self, rows: StepRows, flags: list, flag_meta: list) -> None:
        """The statistics rows of a part of this step (see :meth:`_end_window`), less its weight rows."""
        saved, self._pending_scalars = self._pending_scalars, []
        try:
            host_rows, host_flags, _ = self._to_host(rows, flags)
        finally:
            self._pending_scalars = saved
        keep = [i for i, m in enumerate(rows.meta) if m[1] != "weight"]
        meta, host_rows = _measured([rows.meta[i] for i in keep], host_rows[keep])
        if meta:
            self.writer.add_stat_rows(self.step, meta, host_rows, _stats.N_FIELDS)
        self.attribution.observe(self.step, meta, host_rows, flag_meta, host_flags, self._scaled_loss_active)

    # -- the step boundary -----------------------------------------------------------------
    def end_step(self) -> None:
        """Read this step's device buffers (one host transfer when recording) and write them.
        Raises :class:`StopRun` when the run is decided or its step budget is spent; any other
        failure of ours is logged and never breaks the user's training."""
        if self.closed:
            return
        if self._stopped is not None:
            self._caught_stop()
        try:
            self._end_step()
        except StopRun as e:
            self._stopped = e
            raise
        except Exception as e:
            log.warning("ampdoctor: recording step %d failed: %s: %s", self.step, type(e).__name__, e, exc_info=True)
            self.writer.add_event(self.step, "note", None, message=f"internal error while recording: {type(e).__name__}: {e}")
            self.step += 1
            self._reset_step()

    def _caught_stop(self) -> None:
        """A step ended after this session's StopRun: the script caught it (a bare ``except:``, or
        ``except BaseException:``, around its training step). Nothing more is recorded; the stop is
        raised again at each step boundary, where the script's handler may not be."""
        e = self._stopped
        if not self._stop_caught:
            self._stop_caught = True
            self.note("the script caught ampdoctor's stop (StopRun, a BaseException: a bare `except:` or `except "
                      "BaseException:` in its training loop) and went on training; the steps after it are not "
                      "recorded. Catch `Exception` instead to let --max-steps and bisect's trials end the run.")
            self.writer.commit()
        self.recording = self.attributing = False
        for w in self.watches:
            w.sleep(True)
        self._new_rows()  # (this step's rows are not written)
        self._losses = []
        self._active = False
        raise StopRun(e.reason, e.decision)

    def _end_step(self) -> None:
        while self.foreign_notes:
            self.note(self.foreign_notes.pop(0))
        self.settle_boundary()  # a step that ended with no backward pass since the last boundary
        # On CUDA, with no oracle to decide the step now, the weights' rows and the step's host copy wait
        # for the next backward pass to start: the host queues them there, behind the next forward, where
        # here (after GradScaler's sync) the GPU would wait for them. The weights are the same then, unless
        # the script changes them in between: that is checked, and then they are read here from then on.
        later = (self.recording and not self._boundary_now and self._oracle is None and DEFER_HOST_READ
                 and _HostCopy.defers(self._rows.devices) and not self._parts_ending)
        for w in list(self.watches) if not self._parts_ending else ():  # (a window's parts: read already)
            if self.recording:
                self._follow_tree(w)
            if self.recording and not w.wgrad_rows:
                self._late_weight_grads(w)
            w.wgrad_rows = False
            if later:
                w.mark_weights()
            elif self.recording:
                w.record_weights()
        self._rows.finish()
        step = self.step
        scalars = {
            # gradient accumulation passes loss / n per micro-batch: their sum is the step's loss
            "loss": (self._losses[0] if len(self._losses) == 1 else torch.stack(self._losses).sum()) if self._losses else None,
            "scale": self._scale_after,
            "skipped": self._skipped,
            "optimizer_steps": self._parts_opt_steps if self._parts_ending else self.optimizer_steps,
            "wall": time.time(),
            # an oracle decides every step: the weights' NaN/Inf check where this step has no weight rows
            "params": self._params_screen_safely() if self._oracle is not None and not self.recording else None,
        }
        self._pending_scalars.append((step, scalars))
        rows, row_meta, flags, flag_meta = self._rows, self._row_meta, self._flags, self._flag_meta
        recorded = self.recording
        self.step += 1
        self._reset_step()
        for cb in self.on_step:
            cb(self.step)
        decision = None
        if later:
            self._boundary = (step, list(self.watches), (rows, row_meta, flags, flag_meta, recorded), self._pending_scalars,
                              self.optimizer_steps)
            self._pending_scalars = []
        elif (recorded or self._oracle is not None or len(self._pending_scalars) >= self.config.every
              or _on_host(scalars)):  # (host values: written at once, so a kill loses none of them)
            decision = self._flush_soon(rows, row_meta, flags, flag_meta, recorded)
        self.writer.commit()
        for w in self.watches:  # the next step's hooks: only a recorded step needs them
            if w._leaf_hooks:
                w.drop_leaf_hooks()
            if self.recording and not recorded:  # (a recorded step looked where it ended)
                self._follow_tree(w, before_forward=True)
            if recorded:
                w.prune_pre_hooks()
            w.sleep(not self.recording)
            if self.recording:
                w.snapshot_grads()
        if decision is not None:
            raise StopRun(decision.reason or decision.outcome, decision)
        if self.config.max_steps is not None and self.step >= self.config.max_steps:
            self.writer.add_event(self.step - 1, "stop", None, reason="max_steps", max_steps=self.config.max_steps)
            self.writer.commit()
            raise StopRun("max_steps")

    def _follow_tree(self, w: Any, before_forward: bool = False) -> None:
        """A watched model whose submodules were replaced, removed or added since watch(): the hooks
        move to the model as it is now (the old modules' numbers would be stale), with a note.
        ``before_forward``: seen before a recorded step's forward (else where a recorded step ends,
        after its forward: its weights are the new modules', its activations were the old ones')."""
        if w.tree_changed():
            w.reattach()
            when = (f"from step {self.step} on" if before_forward else
                    f"the weights from step {self.step} on, the activations and gradients from step {self.step + 1}")
            self.note(f"the modules of the watched {type(w.root).__name__} changed after watch() (a layer replaced, "
                      f"added or removed): recorded as they are now, {when}")

    def _params_screen_safely(self) -> tuple | None:
        try:
            return self._params_screen()
        except Exception as e:  # pragma: no cover - never break the user's training for a check (unchecked: None)
            log.warning("ampdoctor: could not check the weights for NaN/Inf at step %d: %s: %s", self.step,
                        type(e).__name__, e)
            return None

    def _params_screen(self) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]] | None:
        """Whether the watched parameters hold a NaN/Inf, for the oracle on a step that records no weight
        rows (a bisect search trial's): per device, a float64 scalar that is 0 when they are all finite,
        and the parameters it covers. One reduction per parameter, no host sync: it travels in the step's
        one host copy with the loss (:meth:`_to_host`). On CUDA with the NVRTC kernels, one launch flags
        them all (exact); elsewhere each parameter's sum (NaN/Inf propagate; ``* 0`` makes a finite total
        0), whose rare overflow from finite weights :meth:`_to_host` checks again exactly."""
        groups: dict[torch.device, list[torch.Tensor]] = {}
        for w in self.watches:
            if w._removed:
                continue
            w._sync_params()
            for _, _, p in w._params:
                if p is not None and p.is_floating_point() and p.layout == torch.strided and not p.is_meta:
                    groups.setdefault(p.device, []).append(p.detach())
        if not groups:
            return None
        pieces = []
        for dev, ts in groups.items():
            if dev.type == "cuda":
                from . import stats_cuda
                if stats_cuda.flags_backend(dev):
                    gate = self._params_gates.get(dev)
                    if gate is None:
                        gate = self._params_gates[dev] = torch.ones(1, dtype=torch.int32, device=dev)
                    pieces.append(stats_cuda.fused_nonfinite(ts, gate).sum())
                    continue
            sums: dict[torch.dtype, list[torch.Tensor]] = {}
            for t in ts:
                x = t.sum() if t.dtype in _NATIVE_SUM else t.sum(dtype=torch.float32)
                sums.setdefault(x.dtype, []).append(x)
            totals = [torch.stack(xs).sum().to(torch.float64) for xs in sums.values()]
            pieces.append((totals[0] if len(totals) == 1 else torch.stack(totals).sum()).mul_(0))
        return pieces, list(groups.values())

    def _late_weight_grads(self, w: Any) -> None:
        """A recorded step whose backward passes left no weight gradient (``torch.autograd.grad``'s
        results assigned to ``.grad``): the gradients the optimizer stepped with, read at the step's end."""
        if self._backward_raised:  # (its .grad: what the pass that raised left half-written)
            return
        w.record_weight_grads()
        if w.wgrad_rows and not self._late_grads_said:
            self._late_grads_said = True
            self.note("weight gradients that no backward() made (torch.autograd.grad results assigned to .grad?) "
                      "are read where the step ends, after the optimizer step (unscaled, if "
                      "GradScaler.unscale_ ran)")

    def _flush(self, rows: list, row_meta: list, flags: list, flag_meta: list, recorded: bool) -> Any:
        host_rows, host_flags, host_scalars = self._to_host(rows, flags)
        row_meta, host_rows = _measured(row_meta, host_rows)
        decision = None
        step = self._pending_scalars[-1][0]
        if recorded and row_meta:
            self.writer.add_stat_rows(step, row_meta, host_rows, _stats.N_FIELDS)
        if recorded:
            self.attribution.observe(step, row_meta, host_rows, flag_meta, host_flags, self._scaled_loss_active)
        for (s, sc), vals in zip(self._pending_scalars, host_scalars):
            loss, scale, skipped, params_screened = vals
            rec = int(s == step and recorded)
            self.writer.add_step((s, loss, scale, None if skipped is None else int(skipped), sc["optimizer_steps"], rec, sc["wall"]))
            if loss is not None and not math.isfinite(loss) and self._detail_left == 0 and self.config.every > 1:
                self._detail_left = DETAIL_AFTER_ANOMALY
                if not self._mid_step:  # the next step is recorded (mid-step: from the next boundary on)
                    # it is the first of the three (_reset_step decided it before the loss was read)
                    self._detail_left -= 1
                    self.recording = True
                    # and attributed (_reset_step decided that for a step that was not to be recorded)
                    self.attributing = not self.attribution.done(self._scaled_loss_active)
            if self._oracle is not None and decision is None:
                params_finite, grads = params_screened, None
                if s == step and recorded:
                    params_finite = not any(m[1] == "weight" and b for m, b in zip(row_meta, bad_rows(host_rows)))
                    grads = _grads_held(row_meta, host_rows)
                decision = self._oracle.observe(s, loss, scale, None if skipped is None else bool(skipped), params_finite,
                                                grads)
                if decision is None and self.config.pass_after is not None and s + 1 >= self.config.pass_after \
                        and self._oracle.settled():  # (not in the middle of a NaN streak: it may yet fail)
                    decision = self._oracle.finish()
                if decision is not None:
                    self.decision = decision
                    self.writer.add_event(decision.step if decision.step is not None else s, "decision", None,
                                          outcome=decision.outcome, reason=decision.reason)
        self._pending_scalars.clear()
        return decision

    def _flush_soon(self, rows: StepRows, row_meta: list, flags: list, flag_meta: list, recorded: bool,
                    scalars: list | None = None) -> Any:
        """:meth:`_flush` this step's data, now or, on CUDA without an oracle, later: the
        device-to-host copy starts now (non-blocking, into pinned memory) and is read where the next
        backward pass ends if it has arrived (:meth:`_write_arrived`), else when a later backward pass
        starts (:meth:`_write_deferred`), or at a later boundary, when it has long
        arrived, so neither the step boundary nor the host work waits for the GPU. With an oracle
        (bisect's trials) every step is decided at once. ``scalars``: the steps'
        losses and scales (default: those pending, taken)."""
        prev, self._deferred = self._deferred, []
        if scalars is None:
            scalars, self._pending_scalars = self._pending_scalars, []
        copy = self._start_copy(rows, scalars)
        job = (copy, rows, row_meta, flags, flag_meta, recorded, scalars)
        first = None
        for p in prev:  # one the next step's backward did not write (see on_backward)
            first = self._run_flush(p) or first
        if copy.on_cuda and self._oracle is None and DEFER_HOST_READ:
            self._deferred = [job]
            return first
        return self._run_flush(job) or first

    def _run_flush(self, job: tuple | None) -> Any:
        if job is None:
            return None
        copy, rows, row_meta, flags, flag_meta, recorded, scalars = job
        saved, self._pending_scalars = self._pending_scalars, scalars
        self._prefetched = copy
        try:
            return self._flush(rows, row_meta, flags, flag_meta, recorded)
        finally:
            self._prefetched = None
            self._pending_scalars = saved

    def settle_boundary(self) -> None:
        """The weights' rows and the host copy of the step that ended last, if they wait (see
        :meth:`_end_step`): the weights are read now, and the copy starts (read later)."""
        b, self._boundary = self._boundary, None
        if b is None:
            return
        step, watches, (rows, row_meta, flags, flag_meta, recorded), scalars, optimizer_steps = b
        try:
            for w in watches:
                w.record_weights(rows)
            changed = [w for w in watches if w.weights_changed()]
            rows.finish()  # (a row that could not be measured is forgotten)
            if changed and not self._boundary_now:
                self._boundary_now = True
                why = ("another optimizer stepped after the step ended (at the first optimizer's step)"
                       if self.optimizer_steps != optimizer_steps else "the script changed them (clipped, reloaded, ...)")
                self.writer.add_event(step, "note", None, message=(
                    f"the weights changed between the end of step {step} and the next backward pass: {why}. The weight "
                    "rows of that step show them as changed; from the next step on they are read where each step ends"))
        except Exception as e:  # pragma: no cover - never break the user's training for a statistic
            log.warning("ampdoctor: could not record the weights of step %d: %s: %s", step, type(e).__name__, e)
        try:
            self._flush_soon(rows, row_meta, flags, flag_meta, recorded, scalars)
        except Exception as e:  # pragma: no cover - never break the user's training for a statistic
            log.warning("ampdoctor: could not write step %d: %s: %s", step, type(e).__name__, e)

    def sync(self) -> None:
        """Write the recorded step whose host copy is still in flight (syncs with the device)."""
        self.settle_boundary()
        jobs, self._deferred = self._deferred, []
        for job in jobs:
            decision = self._run_flush(job)
            if decision is not None and self.decision is None:  # pragma: no cover - no oracle when deferred
                self.decision = decision
        self.writer.commit()

    def _write_deferred(self, settle: bool = True) -> None:
        """Write the deferred step(s) from inside a later step, when its backward pass starts, and
        (``settle``) measure the weights of the step that ended last and start its host copy: the host
        has queued the whole forward by then, so this host work overlaps the GPU's, where at the step
        boundary the GPU would wait for it. Never raises (no oracle when deferred)."""
        jobs, self._deferred = self._deferred, []
        mid, self._mid_step = self._mid_step, True  # (a non-finite loss read here: detail from the next boundary)
        try:
            for job in jobs:
                self._run_flush(job)
            if settle:
                self.settle_boundary()  # the step that just ended: its weights' rows and host copy (read later)
        except Exception as e:  # pragma: no cover - never break the user's training for a statistic
            log.warning("ampdoctor: could not write step statistics: %s: %s", type(e).__name__, e)
        finally:
            self._mid_step = mid

    def _write_arrived(self) -> None:
        """Where a backward pass ends: write the deferred step(s) if their host copy has arrived (it
        started where this pass began, behind the forward, so it usually has): no wait, and a step is
        written one step after it, not two. One still in flight waits for the next backward pass to
        start. Runs in autograd's final callback; never raises."""
        try:
            arrived = not self.closed and all(job[0].arrived() for job in self._deferred)
        except Exception as e:  # pragma: no cover - never break the user's backward for a statistic
            log.warning("ampdoctor: could not check a host copy: %s: %s", type(e).__name__, e)
            return
        if arrived:
            self._write_deferred(settle=False)

    def _start_copy(self, rows: StepRows, scalars: list) -> _HostCopy:
        """Start the step's single device-to-host transfer (one per device; no sync)."""
        copy = _HostCopy()
        for b in rows.device_pieces():
            copy.put("block", b)
        for _, sc in scalars:
            for key in ("loss", "scale", "skipped"):
                if sc[key] is not None:
                    copy.put(key, sc[key])
            if sc.get("params") is not None:
                for piece in sc["params"][0]:
                    copy.put("params", piece)
        copy.start()
        return copy

    def _to_host(self, rows: StepRows, flags: list) -> tuple[np.ndarray, np.ndarray, list]:
        """Everything the step produced, from its one transfer per device (the only host sync;
        already arrived when the read was deferred)."""
        width = _stats.row_width(self.fmt)
        copy = self._prefetched or self._start_copy(rows, self._pending_scalars)
        take = copy.reader()
        table = rows.host_table([take("block") for _ in range(len(rows.blocks) + len(rows.fblocks))], width)
        host_rows = table[rows.slots] if rows.slots else np.zeros((0, width))
        host_flags = np.zeros(len(flags))
        if flags:
            bad = bad_rows(table, rows.dropped)  # per slot, as rows.nonfinite
            if any(bad):  # else every flag is 0 (most steps)
                host_flags = np.array([float(any(bad[s] for s in f)) for f in flags])
        host_scalars = []
        for _, sc in self._pending_scalars:
            vals = []
            for key in ("loss", "scale", "skipped"):
                if sc[key] is None:
                    vals.append(None)
                else:
                    vals.append(float(take(key)[0]))
            screen = sc.get("params")
            if screen is None:
                vals.append(None)
            else:
                pieces, groups = screen
                suspect = [ts for _, ts in zip(pieces, groups) if float(take("params")[0]) != 0]
                # (a sum that overflowed from finite weights is a false alarm: the exact check, only then)
                vals.append(not any(bool(_stats.batch_nonfinite(ts).any()) for ts in suspect))
            host_scalars.append(vals)
        return host_rows, host_flags, host_scalars

    @property
    def first_nonfinite(self) -> dict | None:
        """The first first-non-finite event of the run (see :mod:`ampdoctor.attribution`)."""
        return self.attribution.first

    # -- the end ---------------------------------------------------------------------------
    def close(self, status: str = "finished", **meta: Any) -> None:
        """Flush a partial last step (if anything ran since the last boundary), undo every patch,
        close the trace. Syncs with the device and the writer thread. Idempotent."""
        if self.closed:
            return
        def last_write(write: Callable[[], Any], what: str) -> None:
            try:
                write()
            except StopRun:
                pass
            except Exception as e:  # pragma: no cover - never mask the user's own error
                log.warning("ampdoctor: could not write %s: %s", what, e)

        try:
            if self._window:  # the run's steps ended before a round was learnt: the parts set aside are a step
                last_write(self._end_window, "the last step")
            # a partial last step: what ran since the last boundary, if it has rows or trained (a watched
            # call that only returned after the boundary is not a step: a module whose forward runs the
            # optimizer step, as Lightning's training_step called through DDP)
            if self._row_meta or self._worked:
                last_write(self._partial_step, "the last step")
                meta["last_step_partial"] = True  # (the report: the last step counted ended before its boundary)
            if self._pending_scalars:  # steps not recorded since the last write (every > 1)
                last_write(lambda: self._flush_soon(StepRows(self._row_policy), [], [], [], False), "the last steps")
        finally:
            if self._deferred or self._boundary is not None:  # (a waiting step has no pending scalars left)
                try:
                    self.sync()
                except Exception as e:  # pragma: no cover - never mask the user's own error
                    log.warning("ampdoctor: could not write the last recorded step: %s", e)
            if self._oracle is not None and self.decision is None and self.step > 0:
                try:
                    self.decision = self._oracle.finish()
                except Exception as e:  # pragma: no cover
                    log.warning("ampdoctor: oracle could not finish: %s", e)
            self.closed = True
            for w in list(self.watches):
                w._detach_hooks()
            self.watches.clear()
            self.tracker.uninstall()
            if self.last_output_nonfinite is not None:
                try:
                    step, flag = self.last_output_nonfinite
                    if bool(flag):
                        self.writer.set_meta(last_output_nonfinite_step=step)
                except Exception:  # pragma: no cover - a broken device must not lose the trace
                    pass
            if self._stop_caught and status == "finished":
                status = "stopped"  # (the script caught the stop, and ended on its own later)
            waited = getattr(self.writer, "waited", 0.0)
            if waited:
                self.note(f"the trace writer fell behind (over {self.writer.MAX_PENDING >> 20} MB of rows waiting): "
                          f"training waited {waited:.1f} s at step boundaries for it to catch up, so the step times "
                          "of this run are not the script's own; record fewer steps (every=N) on this disk",
                          waited_s=round(waited, 3))
            self.writer.set_meta(status=status, ended=time.time(), steps=self.step,
                                 optimizer_steps=self.optimizer_steps, **meta)
            self.writer.commit()
            self.writer.close()
            if _current() is self:
                _set_current(None)
            try:
                atexit.unregister(self._at_exit)
            except Exception:  # pragma: no cover
                pass

    def write_out(self) -> None:
        """Make everything recorded so far readable in the trace: the last recorded step, if its host copy
        is still in flight (syncs with the device), then the writer's queue, committed (``w.report()``,
        ``remove()`` of one of several watches). After :meth:`close` the trace is complete already."""
        if self.closed:
            return
        self.sync()
        self.writer.commit()
        self.writer.flush()

    def on_hard_exit(self, code: Any) -> None:
        """``os._exit(code)`` in a script whose watch was never removed (see ``steps._exit_wrapper``)."""
        self._close_with_exit_code(code)

    def _close_with_exit_code(self, code: Any) -> None:
        """Ends the trace as a process exiting with ``code`` ends: ``None`` or 0 finished; another int
        exited with it; anything else (``sys.exit("message")``) exited 1, the message printed."""
        if code is None or code == 0:
            self.close("finished", exit_code=0)
        elif isinstance(code, int):
            self.close("exited", exit_code=code)
        else:
            self.close("exited", exit_code=1, error=str(code))

    def on_sys_exit(self, code: Any) -> None:
        """``sys.exit(code)`` in a script whose watch was never removed (see ``steps._sys_exit_wrapper``)."""
        self._sys_exit = (code, self.step)

    def _at_exit(self) -> None:
        """The end of a script whose watch was never removed: how it ended, as ``ampdoctor run``
        records it. An uncaught exception that ends the interpreter is left in ``sys.last_value``
        before exit handlers run (a KeyboardInterrupt: interrupted); a ``SystemExit`` is not, so the
        code of the last ``sys.exit()`` is taken, unless steps were trained after it (it was caught)."""
        exc = getattr(sys, "last_value", None)
        if exc is None or exc is self._exc_at_start:
            code, at = self._sys_exit or (None, self.step)
            self._close_with_exit_code(code if at == self.step else None)
        elif isinstance(exc, KeyboardInterrupt):
            self.close("interrupted", error="KeyboardInterrupt")
        else:
            self.close("crashed", error=f"{type(exc).__name__}: {exc}")

    def _partial_step(self) -> None:
        saved = self.config.max_steps, self._oracle
        self.config.max_steps, self._oracle = None, None
        try:
            self.end_step()
        finally:
            self.config.max_steps, self._oracle = saved


_DTYPE_NAMES: dict = {}


def _dtype_name(dtype: torch.dtype) -> str:
    """``str(dtype)`` without ``torch.`` (cached: once per dtype, not per row)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


_CURRENT: Session | None = None


def _current() -> Session | None:
    return _CURRENT


def _set_current(s: Session | None) -> None:
    global _CURRENT
    _CURRENT = s


def _forked() -> None:
    """In a child forked from a process that records (a DataLoader worker; ``multiprocessing`` with the
    fork start method): the copy of the session it inherited goes, as if the parent had called
    ``remove()`` before the fork, without writing anything: its trace is the parent's (the writer's
    pipe is dropped in :mod:`ampdoctor.trace`), so nothing the child runs is recorded into it, and a
    ``watch()`` in the child starts a session of its own. What a bisect trial forced to FP32 stays
    forced (the child runs the trial's model)."""
    global _CURRENT
    s, _CURRENT = _CURRENT, None
    if s is None or s.closed:
        return
    s.closed = True
    try:
        for w in list(s.watches):
            w._detach_hooks(unforce=False)
        s.watches.clear()
        s.tracker.uninstall()
        if not s.owned:
            atexit.unregister(s._at_exit)
    except Exception as e:  # pragma: no cover - a fork must not fail because of us
        log.warning("ampdoctor: could not take the watch out of a forked process: %s: %s", type(e).__name__, e)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def _not_the_runs_process() -> bool:
    """Whether this process is one that the script run by ``ampdoctor run``/``bisect`` started itself
    (``multiprocessing``: ``torch.multiprocessing.spawn``'s workers), not the process that runs it nor a
    rank taken over (:mod:`ampdoctor.rank_boot`): it inherited the run's configuration, and writing into
    the run's trace would mix its steps with another process's."""
    pid = os.environ.get(rank_boot.PARENT_VAR, "")
    return pid.isdigit() and int(pid) != os.getpid()


def get_session(create: bool = True, **overrides: Any) -> Session | None:
    """The process's session: the CLI's if one runs, else a new one from the environment's
    configuration (``AMPDOCTOR_CONFIG``) updated with ``overrides``."""
    global _CURRENT
    if _CURRENT is not None and not _CURRENT.closed:
        return _CURRENT
    if not create:
        return None
    cfg = RunConfig.from_env()
    if cfg is not None and _not_the_runs_process():
        cfg = None
        print(f"ampdoctor: this process (pid {os.getpid()}) was started by the script that `ampdoctor run`/`bisect` "
              "runs (multiprocessing, e.g. torch.multiprocessing.spawn), which the run does not follow: a watch() "
              "here records on its own, as outside ampdoctor, not into the run's trace", file=sys.stderr)
    cfg = cfg or RunConfig()
    for k, v in overrides.items():
        if v is not None:
            setattr(cfg, k, v)
    _CURRENT = Session(cfg)
    return _CURRENT
