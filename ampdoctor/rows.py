"""One step's statistics rows, measured in batches.

Hooks hand tensors over (:meth:`StepRows.add_row`, :meth:`StepRows.flag_slots`); they wait in a
batch and are measured together (:func:`ampdoctor.stats.batch_stats`: one fused launch on CUDA)
at *flush points*:

* the batch's bytes exceed a budget (:data:`BUDGET_BYTES`; on CUDA 3% of the peak memory of the
  first recorded step, within 16 MiB..1 GiB): the tensors it holds stay alive until then. On CUDA
  a batch past its budget may keep growing while the device's allocated memory stays a budget
  below that peak (:meth:`RowPolicy.room`): most of what a batch holds (forward outputs that
  autograd saves) is alive anyway, and memory under the peak training reaches on its own costs
  nothing. It is checked again each time the batch grows by two budgets;
* a module with ``inplace=True`` (``nn.ReLU(inplace=True)``, dropout, ...) is about to run;
* each backward pass ends (an autograd final callback): before ``GradScaler.unscale_``,
  gradient clipping or the next micro-batch change gradients in place;
* the step boundary.

A tensor is measured once per step however many hooks ask for it (the same object at the same
``_version``): the non-finite flags used for first-non-finite attribution are read off the rows of
the tensors they concern, so they cost no kernel of their own.

In-place safety. A tensor changed in place between its hook and its flush would be measured
after the change. So the first recorded step measures every tensor at once, in its hook (as the
unbatched path did), and also lets it wait in the batch as later steps will, to learn which
tensors change before their flush (their ``_version`` moved): from then on those are measured at
once, in their hooks; the rest wait in the batch.
Each flush checks ``_version`` again; a tensor that changed anyway (the model took another code
path) is not written (its row would describe other numbers): a note says so, and it is measured
at once from then on.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any, Callable, Hashable, Sequence

import numpy as np
import torch

from . import stats as _stats
from .formats import Format

log = logging.getLogger(__name__)

BUDGET_BYTES = 64 << 20  # bytes of tensors held by a batch before it is measured (CUDA: see fit_budget)
_DEFAULT_BUDGET = BUDGET_BYTES
_weakref = weakref.ref
EAGER = os.environ.get("AMPDOCTOR_EAGER", "0") == "1"  # measure every tensor in its hook (no batching)
# tensors measured only for a first-non-finite flag get a NaN/Inf check behind the step's gate
# (see StepRows.flag_slots); "0": full statistics rows for them too, as rows of their own
GATED_FLAGS = os.environ.get("AMPDOCTOR_FLAG_GATE", "1") != "0"
# why a flag-only slot's gated check may have to wait (StepRows.slot_of's hold): HOLD_CALL, a module
# call's input (or a container's output) until a call that took it returns; HOLD_PASS, a gradient
# until the outermost backward pass ends
HOLD_CALL, HOLD_PASS = 1, 2


def _allocated(dev: torch.device) -> int:
    """Bytes allocated on a CUDA device now. The raw counters: ``torch.cuda.memory_allocated``
    flattens every allocator statistic in Python first (about 0.3 ms a call)."""
    raw = getattr(torch._C, "_cuda_memoryStats", None)
    if raw is not None:
        try:
            return raw(dev.index if dev.index is not None else torch.cuda.current_device())["allocated_bytes"]["all"]["current"]
        except Exception:  # another layout in another torch: the public call
            pass
    return torch.cuda.memory_allocated(dev)


class RowPolicy:
    """What the steps of a session learn and share: tensors that must be measured at once."""

    def __init__(self, fmt: Format, budget: int | None = None,
                 on_stale: Callable[[Hashable], None] | None = None):
        self.fmt = fmt
        self.budget = budget if budget is not None else BUDGET_BYTES
        self._fit = budget is None and BUDGET_BYTES == _DEFAULT_BUDGET
        self.volatile: set = set()  # keys whose tensors change in place after their hook
        self.calibrated = False      # False until the first recorded step has ended
        self.on_stale = on_stale
        self._cuda_tried = False
        self.peaks: dict = {}  # CUDA device -> peak allocated bytes when the first recorded step ended
        self._gated: dict = {}  # device -> whether flag-only tensors get the gated NaN/Inf check there

    def fit_budget(self, devices: set) -> None:
        """On CUDA, after the first recorded step: a budget of 3% of the peak memory so far
        (within 16 MiB..1 GiB), so holding a batch stays a small fraction of what training holds
        anyway. Reads the allocator's counters only (no sync)."""
        if not self._fit:
            return
        self.peaks = {d: torch.cuda.max_memory_allocated(d) for d in devices if d.type == "cuda"}
        if self.peaks:
            self.budget = int(min(1 << 30, max(16 << 20, 0.03 * max(self.peaks.values()))))

    def room(self, pending: int) -> bool:
        """Whether a batch of ``pending`` bytes, past its budget, may grow by another
        :attr:`step`: on every CUDA device of the session, allocated memory plus a step stays
        under the peak of the first recorded step, and the batch under a quarter of that peak.
        Reads the allocator's counters (no sync)."""
        if not self.peaks:
            return False
        for d, peak in self.peaks.items():
            if pending > peak // 4 or _allocated(d) + self.step > peak:
                return False
        return True

    @property
    def step(self) -> int:
        """How much a batch past its budget grows between two looks at the allocator."""
        return 2 * self.budget

    def gated(self, dev: torch.device) -> bool:
        """Whether tensors measured only for a flag get the gated NaN/Inf check on ``dev``
        (the CPU, and CUDA devices served by the NVRTC kernels) rather than a full row."""
        ok = self._gated.get(dev)
        if ok is None:
            ok = False
            if GATED_FLAGS and not EAGER:
                if dev.type == "cpu":
                    ok = True
                elif dev.type == "cuda":
                    from . import stats_cuda
                    try:
                        ok = _stats._backend is stats_cuda.fused_batch_stats and stats_cuda.flags_backend(dev)
                    except Exception:  # pragma: no cover - no NVRTC: full rows
                        ok = False
            self._gated[dev] = ok
        return ok

    def cuda_seen(self) -> None:
        if not self._cuda_tried:
            self._cuda_tried = True
            from . import stats_cuda
            stats_cuda.install()


class StepRows:
    """Rows of one step. ``meta``/``slots``: one entry per statistics row (the trace's rows);
    a *slot* is one measured tensor, shared by the rows and flags that concern it."""

    def __init__(self, policy: RowPolicy):
        self.policy = policy
        self.meta: list[tuple] = []
        self.slots: list[int] = []
        self.n_slots = 0
        self.blocks: list[tuple[torch.Tensor, list[int]]] = []  # (rows on device, their slots)
        self.dropped: set[int] = set()
        self._pending: list[tuple[int, torch.Tensor, int, Hashable, bool, torch.device]] = []  # (.., measured, device)
        self._pending_bytes = 0
        self._check_at = policy.budget  # pending bytes at which the batch is flushed or let grow
        self._seen: dict[int, tuple[Any, int, int]] = {}  # id(t) -> (weakref, _version, slot)
        self.changed = 0  # look-ups that found a tensor changed in place since its slot was made
        self._devices: set[torch.device] = set()
        # tensors measured only for a NaN/Inf flag (see flag_slots): slot -> its waiting entry
        # (slot, t, _version, key, device), None once measured
        self._fslots: dict[int, tuple | None] = {}
        self._fpending: dict[int, tuple] = {}
        # waiting flag-only slots that no row measured so far may show yet (see flush): a module input
        # whose call has not returned, a container output no call that read it has returned (HOLD_CALL)
        self._open: set[int] = set()
        self._held: set[int] = set()     # gradients, until the outermost backward pass ends (HOLD_PASS)
        self._checked: set[int] = set()  # held slots checked at a flush already (see _measure_flags)
        self.fblocks: list[tuple[torch.Tensor, list[int]]] = []  # (flags on device, their slots)
        self._gates: dict[torch.device, torch.Tensor] = {}  # CUDA: this step's gate, per device
        self._cpu_open = False  # the CPU's gate: a CPU row of this step counted a NaN or an Inf
        self._cpu_scan = 0      # blocks looked at for it
        self._cpu_losses: list[torch.Tensor] = []  # CPU losses that open it too (see open_gate_on)

    def __bool__(self) -> bool:
        return self.n_slots > 0

    @property
    def devices(self) -> set[torch.device]:
        """The devices of the tensors measured so far."""
        return self._devices

    def remeasure(self, fmt: Format) -> bool:
        """Measure again, against ``fmt``, every row measured so far this step: a format decided
        after the step began measuring (the first watched forward enters autocast inside the
        model's own ``forward``, as accelerate and the HF Trainer wrap it, after the outer modules'
        inputs were measured). Possible only while every measured tensor is still at hand and
        unchanged (the first recorded step keeps its eagerly measured tensors waiting in the batch
        until its first flush); otherwise nothing changes and it returns False."""
        if self.fblocks or self.dropped:
            return False
        at_hand: dict[int, torch.Tensor] = {}
        for ref, ver, slot in self._seen.values():
            t = ref()
            if t is not None and t._version == ver:
                at_hand[slot] = t
        for slot, t, ver, _key, _measured, _dev in self._pending:
            if t._version == ver:
                at_hand[slot] = t
        if any(s not in at_hand for _, ss in self.blocks for s in ss):
            return False
        blocks = []
        for _, ss in self.blocks:
            ts = [at_hand[s] for s in ss]
            gate = self._gates.get(ts[0].device)
            blocks.append((_stats.batch_stats(ts, fmt) if gate is None else _stats.batch_stats(ts, fmt, gate), ss))
        self.blocks = blocks
        return True

    # -- from the hooks ------------------------------------------------------------------
    def slot_of(self, t: torch.Tensor, key: Hashable, nbytes: int | None = None, flag: bool = False,
                hold: int = 0) -> int:
        """The slot measuring ``t`` as it is now (no host sync). ``nbytes``: ``t``'s size in bytes
        when the caller knows it already. ``flag``: only its NaN/Inf flag is needed (see
        :meth:`flag_slots`); otherwise the slot gives a full row. ``hold``: why a flag-only slot's
        gated check may have to wait (:data:`HOLD_CALL`, until :meth:`release`; :data:`HOLD_PASS`;
        see :meth:`flush`)."""
        hit = self._seen.get(id(t))
        if hit is not None:
            if hit[1] == t._version:
                if hit[0]() is t:
                    slot = hit[2]
                    if flag or slot not in self._fslots:
                        if hold and slot in self._fpending:
                            (self._open if hold == HOLD_CALL else self._held).add(slot)
                        return slot
                    return self._upgrade(slot, t, key, nbytes)
            elif hit[0]() is t:
                self.changed += 1
        return self._new_slot(t, key, nbytes, flag, hold)

    def release(self, slots: Sequence[int]) -> None:
        """A module call that took ``slots``' tensors as inputs returned: its outputs come next, with
        no flush before them, so their gated checks may run at any flush from now on."""
        if self._open:
            for s in slots:
                self._open.discard(s)

    def _upgrade(self, slot: int, t: torch.Tensor, key: Hashable, nbytes: int | None) -> int:
        """A row is wanted of a tensor that had a flag-only slot: the slot becomes a full one if
        it still waits; if it was measured already, ``t`` gets a new, full slot."""
        self._fslots.pop(slot)
        self._open.discard(slot)
        self._held.discard(slot)
        entry = self._fpending.pop(slot, None)
        if entry is not None:
            _, _, ver, k, dev = entry
            self._pending.append((slot, t, ver, k, False, dev))
            return slot
        del self._seen[id(t)]
        return self._new_slot(t, key, nbytes)

    def _new_slot(self, t: torch.Tensor, key: Hashable, nbytes: int | None = None, flag: bool = False,
                  hold: int = 0) -> int:
        ver = t._version
        slot = self.n_slots
        self.n_slots += 1
        try:
            self._seen[id(t)] = (_weakref(t), ver, slot)
        except TypeError:  # pragma: no cover - tensors take weak references
            pass
        dev = t.device
        if dev not in self._devices:
            self._see_device(dev)
        pol = self.policy
        measured = False
        if EAGER or not pol.calibrated or (pol.volatile and key in pol.volatile):
            try:
                gate = self._gates.get(dev)
                self.blocks.append((_stats.batch_stats([t], pol.fmt) if gate is None else
                                    _stats.batch_stats([t], pol.fmt, gate), [slot]))
            except Exception:
                self.dropped.add(slot)
                raise
            if pol.calibrated or EAGER:
                return slot
            measured = True  # calibration: also wait in the batch, to learn whether it would go stale
        elif flag and pol.gated(dev):
            entry = (slot, t, ver, key, dev)
            self._fslots[slot] = self._fpending[slot] = entry
            if hold:
                (self._open if hold == HOLD_CALL else self._held).add(slot)
            # its bytes count towards the batch, but a flag never starts a flush itself: the tensor
            # recorded next (its module's output, ...) is measured with it, before its gate is read
            # (a held one: see flush)
            self._pending_bytes += t.numel() * t.element_size() if nbytes is None else nbytes
            return slot
        self._pending.append((slot, t, ver, key, measured, dev))
        self._pending_bytes += t.numel() * t.element_size() if nbytes is None else nbytes
        if self._pending_bytes > self._check_at:
            if pol.room(self._pending_bytes):
                self._check_at = self._pending_bytes + pol.step
            else:
                self.flush()
        return slot

    def _see_device(self, dev: torch.device) -> None:
        self._devices.add(dev)
        if dev.type == "cuda":
            self.policy.cuda_seen()
            if self.policy.gated(dev):  # the step's gate: set by the stats of any row with NaN/Inf
                self._gates[dev] = torch.zeros(1, dtype=torch.int32, device=dev)

    def add_now(self, metas: Sequence[tuple], tensors: Sequence[torch.Tensor], memo: dict | None = None) -> None:
        """Rows ``metas`` of ``tensors``, each in a slot of its own, measured now with the tensors
        waiting in the batch (one launch per device): for tensors that nothing else asks for this
        step (weights, weight gradients), read where they must be, at a flush point. ``memo``: the
        caller's, for tensors that come back with the same dtypes and sizes at each call (see
        :func:`ampdoctor.stats_cuda.planned_rows`)."""
        if not tensors:
            return
        start = self.n_slots
        self.n_slots += len(tensors)
        devs = [t.device for t in tensors]
        for dev in set(devs) - self._devices:
            self._see_device(dev)
        self.meta.extend(metas)
        self.slots.extend(range(start, self.n_slots))
        self.flush((tensors, range(start, self.n_slots), devs), memo=memo)

    def add_row(self, meta: tuple, t: torch.Tensor, key: Hashable) -> None:
        """A statistics row ``meta`` (whose last field is ``t``'s size in bytes) measuring ``t``."""
        hit = self._seen.get(id(t))
        if hit is not None and hit[1] == t._version and hit[0]() is t:
            slot = hit[2]
            if slot in self._fslots:
                slot = self._upgrade(slot, t, key, meta[-1])
        else:
            slot = self._new_slot(t, key, meta[-1])
        self.meta.append(meta)
        self.slots.append(slot)

    def flag_slots(self, tensors: Sequence[torch.Tensor], key: Hashable, hold: int = 0) -> tuple[int, ...] | None:
        """Slots that say whether ``tensors`` hold NaN/Inf (``None`` if all are empty).

        A tensor that has a row anyway is read off its row. One measured for its flag alone (a
        module input that no module outputs, such as a residual sum, and its gradient) gets a
        NaN/Inf check, measured after the rows of its batch and behind the step's *gate*: only
        once a row measured so far in the step (that batch included) counted a NaN or an Inf.
        On a step where nothing did, these tensors are not read at all and their flags are 0:
        a NaN in such a tensor shows in the rows after it (its module's output), which opens the
        gate before it is checked. ``hold``: that row may come after the next flush (see
        :meth:`slot_of`). Where the gate is not available (no NVRTC, EAGER), such tensors get full
        rows as before."""
        if len(tensors) == 1:  # the common case, without a generator
            t = tensors[0]
            if not t.numel():
                return None
            return (self.slot_of(t, (key, 0), None, True, hold),)
        out = tuple(self.slot_of(t, (key, i), None, True, hold) for i, t in enumerate(tensors) if t.numel())
        return out or None

    def open_gate_on(self, loss: torch.Tensor) -> None:
        """A loss a backward pass starts from: a NaN/Inf in it opens the gate of its device as a row's
        would (no sync). A tensor whose NaN/Inf no module reads (a model whose output is its own
        residual sum, under a mean loss whose backward stays finite) shows in the loss alone."""
        dev = loss.device
        if dev.type == "cuda":
            gate = self._gates.get(dev)
            if gate is not None:
                torch.bitwise_or(gate, _stats.nonfinite_any(loss).to(gate.dtype), out=gate)
        elif dev.type == "cpu" and not self._cpu_open and self.policy.gated(dev):
            self._cpu_losses.append(loss.detach())

    # -- flush points --------------------------------------------------------------------
    def flush(self, now: tuple[Sequence[torch.Tensor], Sequence[int], list[torch.device]] | None = None,
              flags: bool = False, memo: dict | None = None) -> None:
        """Measure the waiting tensors now (kernel launches; no host sync), with ``now``'s
        (tensors, their slots, their devices): tensors handed over to be measured at once.

        The gated checks of flag-only tensors run after the rows, but the row that would open the
        gate for some may not be in yet (see :meth:`slot_of`'s ``hold``). The input of a module call
        that has not returned (a budget flush before its output; the flush before an in-place
        module, which is about to overwrite it), or a container's output that no call that read it
        has returned, gets a full row in this flush, as without the gate: it may have changed by
        the time a row shows it. A gradient, whose rows come as the backward pass goes on (and a
        nested backward pass, a reentrant checkpoint's, flushes in the middle of the outer one),
        is checked now and again at each flush until a *safe* one (``flags``: the end of the
        outermost backward pass, the step's end), when every row that could show its NaN/Inf is
        in; its flag is any check's. Gradients held past the budget that cannot wait
        (:meth:`RowPolicy.room`) get full rows in this flush instead. ``memo``: ``now``'s tensors,
        all on one CUDA device, are measured on their own through a kept launch plan (see
        :meth:`add_now`), after the waiting rows and before the gated checks, as in one batch."""
        if flags:
            self._open.clear()
            self._held.clear()
        else:
            if self._open:
                for slot in list(self._open):
                    self._upgrade(slot, self._fpending[slot][1], None, None)
            if self._held:
                self._rows_for_held()
        if not self._pending and now is None:
            if self._fpending:
                self._measure_flags()
            return
        pol = self.policy
        pending, self._pending, self._pending_bytes = self._pending, [], 0
        self._check_at = pol.budget
        by_dev: dict[torch.device, tuple[list, list]] = {}
        for slot, t, ver, key, measured, dev in pending:
            if t._version != ver:
                pol.volatile.add(key)
                if not measured:
                    self.dropped.add(slot)
                    if pol.on_stale is not None:
                        pol.on_stale(key)
                continue
            if measured:
                continue
            group = by_dev.get(dev)
            if group is None:
                group = by_dev[dev] = ([], [])
            group[0].append(t)  # batch_stats reads it without building a graph: no detach here
            group[1].append(slot)
        planned = None
        if now is not None:
            ts, ss, devs = now
            if devs.count(devs[0]) == len(devs):  # all on one device
                if memo is not None and devs[0].type == "cuda":
                    planned = (list(ts), list(ss), devs[0])
                else:
                    group = by_dev.setdefault(devs[0], ([], []))
                    group[0].extend(ts)
                    group[1].extend(ss)
            else:
                for t, slot, dev in zip(ts, ss, devs):
                    group = by_dev.setdefault(dev, ([], []))
                    group[0].append(t)
                    group[1].append(slot)
        for dev, (ts, ss) in by_dev.items():
            self._measure(ts, ss, dev)
        if planned is not None:
            self._measure(*planned, memo=memo)
        if self._fpending:
            self._measure_flags()

    def _measure(self, ts: list[torch.Tensor], ss: list[int], dev: torch.device | None = None,
                 memo: dict | None = None) -> None:
        """One batch of tensors (one device) into a block of rows for slots ``ss``; ``memo``: through
        a kept launch plan where it applies (see :func:`ampdoctor.stats_cuda.planned_rows`)."""
        fmt = self.policy.fmt
        gate = self._gates.get(dev) if self._gates else None
        if memo is not None:
            from . import stats_cuda
            try:
                out = (stats_cuda.planned_rows(ts, fmt, gate, memo)
                       if _stats._backend is stats_cuda.fused_batch_stats else None)
            except Exception as e:  # the batch path below, as for any batch
                log.info("ampdoctor: planned statistics failed (%s: %s)", type(e).__name__, e)
                memo.clear()
                out = None
            if out is not None:
                self.blocks.append((out, ss))
                return
        stats = _stats.batch_stats if gate is None else (lambda x, f: _stats.batch_stats(x, f, gate))
        try:
            self.blocks.append((stats(ts, fmt), ss))
        except Exception as e:  # one odd tensor must not cost the batch: measure one by one
            log.info("ampdoctor: batched statistics failed (%s: %s); measuring one by one", type(e).__name__, e)
            for t, slot in zip(ts, ss):
                try:
                    self.blocks.append((stats([t], fmt), [slot]))
                except Exception:
                    self.dropped.add(slot)

    def _rows_for_held(self) -> None:
        """Held gradients past the budget, with no room to wait: full rows, measured now."""
        pol = self.policy
        held = [self._fpending[s] for s in self._held]
        nbytes = sum(e[1].numel() * e[1].element_size() for e in held)
        if nbytes > pol.budget and not pol.room(nbytes):
            for slot, t, *_ in held:
                self._upgrade(slot, t, None, None)

    def _measure_flags(self) -> None:
        """The waiting flag-only tensors: their NaN/Inf checks, behind the gate (after the rows).
        Held gradients are checked too but keep waiting, to be checked again at a later flush
        (their flag: any check's); one changed in place by then keeps the checks it had."""
        pol = self.policy
        waiting, self._fpending = self._fpending, {}
        held, checked = self._held, self._checked
        by_dev: dict[torch.device, tuple[list, list]] = {}
        for entry in waiting.values():
            slot, t, ver, key, dev = entry
            if slot in held and t._version == ver:
                self._fpending[slot] = entry
                checked.add(slot)
            else:
                self._fslots[slot] = None
                held.discard(slot)
            if t._version != ver:
                if slot in checked:  # checked before the change, as a row would have been measured
                    continue
                pol.volatile.add(key)
                self.dropped.add(slot)
                if pol.on_stale is not None:
                    pol.on_stale(key)
                continue
            group = by_dev.get(dev)
            if group is None:
                group = by_dev[dev] = ([], [])
            group[0].append(t)
            group[1].append(slot)
        for dev, (ts, ss) in by_dev.items():
            try:
                if dev.type == "cuda":
                    from . import stats_cuda
                    self.fblocks.append((stats_cuda.fused_nonfinite(ts, self._gates[dev]), ss))
                else:
                    self.fblocks.append((self._cpu_flags(ts), ss))
            except Exception as e:  # pragma: no cover - never break training for a statistic
                log.info("ampdoctor: NaN/Inf checks failed (%s: %s)", type(e).__name__, e)
                self.dropped.update(ss)

    def _cpu_flags(self, ts: list[torch.Tensor]) -> torch.Tensor:
        """The CPU's gated checks: read only once a CPU row of this step counted NaN/Inf."""
        if not self._cpu_open:
            for b, _ in self.blocks[self._cpu_scan:]:
                if b.device.type == "cpu" and bool((b[:, 1:4] != 0).any()):
                    self._cpu_open = True
                    break
            self._cpu_scan = len(self.blocks)
            losses, self._cpu_losses = self._cpu_losses, []
            if not self._cpu_open and losses:
                self._cpu_open = any(bool(_stats.nonfinite_any(loss)) for loss in losses)
        if not self._cpu_open:
            return torch.zeros(len(ts), dtype=torch.float64)
        return _stats.batch_nonfinite(ts)

    def finish(self) -> None:
        """The step's last flush: measure what waits, forget rows that could not be measured."""
        self.flush(flags=True)
        if self.n_slots and not self.policy.calibrated:
            self.policy.calibrated = True
            self.policy.fit_budget(self._devices)
        self._seen.clear()
        if self.dropped:
            keep = [i for i, s in enumerate(self.slots) if s not in self.dropped]
            self.meta[:] = [self.meta[i] for i in keep]
            self.slots[:] = [self.slots[i] for i in keep]

    # -- reading ---------------------------------------------------------------------------
    def device_pieces(self) -> list[torch.Tensor]:
        """The measured blocks (rows, then flags), for the step's single host transfer."""
        return [b for b, _ in self.blocks] + [f for f, _ in self.fblocks]

    def host_table(self, host_blocks: Sequence[np.ndarray], width: int) -> np.ndarray:
        """All slots' rows on the host, ``(n_slots, width)``, from :meth:`device_pieces`' host
        copies; dropped slots are NaN. A flag-only slot's row is zeros but for its NaN count,
        which holds its flag (1 or 0): it is read by :func:`ampdoctor.attribution.bad_rows` only."""
        table = np.full((self.n_slots, width), np.nan)
        nb = len(self.blocks)
        for (_, slots), h in zip(self.fblocks, host_blocks[nb:]):  # a held slot checked more than once: any
            prev = table[slots, 1]
            table[slots] = 0.0
            table[slots, 1] = np.fmax(prev, np.asarray(h).reshape(len(slots)))
        for (_, slots), h in zip(self.blocks, host_blocks[:nb]):  # rows last: a checked slot that got one
            table[slots] = np.asarray(h).reshape(len(slots), width)
        return table

