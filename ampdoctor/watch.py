"""``watch(model)``: forward hooks and output-gradient tensor hooks that feed a
:class:`~ampdoctor.session.Session`. No hook syncs with the GPU.

Activation gradients come from a tensor hook registered on each output inside the forward hook
(not ``register_full_backward_hook``: slow, and it breaks in-place ops); a gradient in a layout other than
the default one (channels_last) is measured from a copy, never held while autograd goes on using it (see
:meth:`Watch._grad_copy`). Weight gradients are read
where each backward pass ends (an autograd final callback), all in one batch: those whose ``.grad``
is new or changed since the last look (no hook per parameter). Weights are read at the step boundary.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import weakref
from collections import OrderedDict
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .naming import WRAPPED_NOTE
from .rows import HOLD_CALL, HOLD_PASS
from .session import Session, _dtype_name, _shown_name, get_session
from .tensors import _MAX_TENSORS, floating, iter_tensors

log = logging.getLogger(__name__)

__all__ = ["watch", "Watch", "unwrap_model"]

_WATCHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # root module -> Watch


def unwrap_model(model: nn.Module) -> tuple[nn.Module, list[str]]:
    """The module whose names users see: through ``torch.compile`` and DDP/FSDP-style wrappers."""
    notes = []
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        inner = getattr(model, "_orig_mod", None)
        if isinstance(inner, nn.Module):
            notes.append("torch.compile-wrapped model: hooks sit on the original modules; compiled "
                         "regions may graph-break around them or skip them")
            model = inner
            continue
        inner = getattr(model, "module", None)
        if isinstance(inner, nn.Module) and type(model).__name__ in (
                "DistributedDataParallel", "DataParallel", "FullyShardedDataParallel"):
            notes.append(f"{type(model).__name__}{WRAPPED_NOTE}")
            model = inner
            continue
    return model, notes


_graph_task_id = torch._C._current_graph_task_id
_compiler = getattr(torch, "compiler", None)
_disable = getattr(_compiler, "disable", None)
_is_compiling = getattr(_compiler, "is_compiling", None) or (lambda: False)
_inference_mode = torch.is_inference_mode_enabled
_exc_info = sys.exc_info
_grad_enabled = torch.is_grad_enabled
_functorch_level = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", lambda: None)
_weakref = weakref.ref
_Tensor = torch.Tensor
_strided = torch.strided


def _in_backward() -> bool:
    return _graph_task_id() != -1


_NO_GRAD_NOTE = ("ran with gradients disabled during training (torch.no_grad() inside the model's forward, or "
                 "checkpoint(..., use_reentrant=True)): its outputs are recorded, with no gradient rows "
                 "(use_reentrant=False records the gradients of checkpointed layers)")
_FUNCTORCH_NOTE = ("calls of the model inside a torch.func transform (vmap, grad, jacrev: per-sample gradients) "
                   "are not recorded: their tensors are functorch wrappers, one per transform level. The weight "
                   "gradients assigned to .grad from them are read where the step ends")
_SPANNED_NOTE = ("returns after the optimizer step that ends the training step it began in (its forward runs "
                 "the whole step): its outputs are not recorded; its layers' rows are")
_SCALARS = (str, bytes, int, float, bool)
_IDX = [str(i) for i in range(_MAX_TENSORS)]


def _flat(items: tuple) -> list[tuple[str, torch.Tensor]] | None:
    """``floating(iter_tensors(items))`` for a tuple of plain tensors, ``None`` and scalars (most
    modules' arguments, and HF modules' tuple outputs), without the generic walk; ``None`` for any
    other tuple (the caller walks it)."""
    out = []
    seen = 0
    for i, a in enumerate(items):
        ta = type(a)
        if ta is _Tensor:
            if seen == _MAX_TENSORS:
                break
            seen += 1
            if a.dtype.is_floating_point and a.layout == _strided and not a.is_meta:
                out.append((_IDX[i] if i < _MAX_TENSORS else str(i), a))
        elif a is not None and ta not in _SCALARS:
            return None
    return out


def _float_outputs(out: Any) -> list[tuple[str, torch.Tensor]]:
    """``floating(iter_tensors(out))``, without the walk for a plain tensor or a flat tuple."""
    if type(out) is _Tensor:
        if out.dtype.is_floating_point and out.layout == _strided and not out.is_meta:
            return [("out", out)]
        return []
    if type(out) is tuple:
        flat = _flat(out)
        if flat is not None:
            return flat
    return floating(iter_tensors(out))


def _float_inputs(args: Any) -> list[torch.Tensor]:
    """``[t for _, t in floating(iter_tensors(args))]``, without the walk for a flat tuple."""
    if type(args) is tuple:
        if len(args) == 1 and type(args[0]) is _Tensor:
            t = args[0]
            if t.dtype.is_floating_point and t.layout == _strided and not t.is_meta:
                return [t]
            return []
        flat = _flat(args)
        if flat is not None:
            return [t for _, t in flat]
    return [t for _, t in floating(iter_tensors(args))]


def _inplace(mod: nn.Module) -> bool:
    """``getattr(mod, "inplace", False) is True``, without raising and catching an AttributeError
    inside ``Module.__getattr__`` for the many modules that have no such attribute."""
    if not hasattr(type(mod), "inplace"):
        d = mod.__dict__
        if "inplace" in d:
            return d["inplace"] is True
        if not any("inplace" in d.get(k, ()) for k in ("_parameters", "_buffers", "_modules")):
            return False
    return getattr(mod, "inplace", False) is True


def _layout_may_change(grad: torch.Tensor) -> bool:
    """Whether holding ``grad`` could change the layout of what autograd makes from it (see
    :meth:`Watch._grad_copy`): autograd adds a later contribution into a gradient in place, or makes it
    a leaf's ``.grad``, only while nobody else holds it; held, the sum is made out of place, and takes a
    layout from both addends. For a gradient in the default (row-major) layout the sum's layout and
    values are the same either way (an IEEE sum does not depend on the order of its two addends); a
    gradient in another dense layout (channels_last, a permuted one, or a row-major one with other
    strides on its size-1 dimensions, as channels_last tensors at 1x1) may come out in another one, and
    convolution kernels pick their algorithm by layout. An expanded gradient (stride 0) is never added
    into in place."""
    if grad.is_contiguous():
        shape = grad.shape
        if 1 not in shape:
            return False
        want, strides = 1, grad.stride()
        for i in range(len(shape) - 1, -1, -1):
            if strides[i] != want:
                return True
            want *= shape[i]
        return False
    return 0 not in grad.stride()


class _GradWork(list):
    """What one watch does with the gradient of one tensor, in the order it was asked for, behind
    a single ``register_hook``: entries ``(True, lid, phase, call)`` (a gin/gout non-finite flag) and
    ``(False, lid, slot, call)`` (a gradient statistics row). Consecutive requests on a tensor share
    its last hook; a hook registered by anyone else in between starts a new one, so the order of all
    hooks on the tensor stays the order of registration. ``rows``: whether an entry is a row (the
    gradient then gets a full row, not a flag-only slot)."""

    __slots__ = ("watch", "rows")

    def add(self, entries: tuple) -> None:
        self.extend(entries)
        if not self.rows:
            for e in entries:
                if not e[0]:
                    self.rows = True

    def __call__(self, grad: torch.Tensor) -> None:
        w = self.watch()  # (weakly held: a tensor kept past remove() keeps neither the watch nor its session alive)
        if w is None or w._removed or grad is None:
            return
        s = w.session
        if s.closed:
            return
        try:
            task = _graph_task_id()
            if s._bw_task != task:
                s._queue_backward_flush()
            if not self.rows and not s.attributing:
                return  # (flag entries only, and no flags wanted now: nothing to measure)
            if _layout_may_change(grad):
                grad = w._grad_copy(grad, task)
            rows = s._rows
            n = grad.numel()
            slot = -1  # one slot for every entry: the same tensor, unchanged within this call
            flags = s._flags
            flag_meta = s._flag_meta
            for is_flag, lid, name, call in self:
                if is_flag:  # Session.add_flag(.., flag_slots(..)), inline (hundreds a step)
                    if not n or not s.attributing:
                        continue
                    if slot < 0:  # a flag-only slot unless a row of it is asked for too
                        slot = rows.slot_of(grad, ((lid, "flag", name), 0), None, not self.rows, HOLD_PASS)
                    flags.append((slot,))
                    flag_meta.append((lid, call, name))
                else:  # Session.add_stats, inline
                    nbytes = n * grad.element_size()
                    if slot < 0:
                        slot = rows.slot_of(grad, (lid, "gradient", name), nbytes)
                    rows.meta.append((lid, "gradient", name, call, _dtype_name(grad.dtype), n, nbytes))
                    rows.slots.append(slot)
        except Exception as e:  # never break the user's backward because of a statistic
            s.note_layer(self[0][1], f"could not record a gradient: {type(e).__name__}: {e}")


def _new_hook(t: torch.Tensor, hook: Any) -> None:
    """``t.register_hook(hook)`` for a plain tensor that requires grad, without the handle (the
    hook is never removed on its own: it goes with the tensor): the same dictionary entry, at the
    same place, with an id taken from the same counter. Another torch: ``register_hook``."""
    try:
        hooks = t._backward_hooks
        if hooks is None:
            t._backward_hooks = hooks = OrderedDict()
            fn = t.grad_fn
            if fn is not None:
                fn._register_hook_dict(t)
        key = RemovableHandle.next_id
        RemovableHandle.next_id = key + 1
        hooks[key] = hook
    except AttributeError:  # pragma: no cover - a torch without these internals
        t.register_hook(hook)


def _nonfinite_flag(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    flags = [(~torch.isfinite(t.detach())).any() for t in tensors if t.numel()]
    if not flags:
        return None
    return torch.stack(flags).any() if len(flags) > 1 else flags[0]


_ScriptModule = torch.jit.ScriptModule


def _script_kind(mod: nn.Module) -> str:
    """A TorchScript module's name as the user knows it: its original class (``Linear``), not ``RecursiveScriptModule``."""
    name = getattr(mod, "original_name", None)
    return str(name) if name else type(mod).__name__


class Watch:
    """Handle returned by :func:`watch`. A context manager; :meth:`remove` is idempotent."""

    def __init__(self, model: nn.Module, session: Session, *, all_modules: bool):
        self.model = model
        self.session = session
        self._ref = _weakref(self)  # what the gradient hooks hold (see _GradWork)
        self._handles: list[Any] = []
        self._params: list[tuple[int, str, nn.Parameter | None]] = []
        self._owners: list[tuple[dict, str]] = []  # (module._parameters, name) of each entry of _params
        self._removed = False
        self._marked: tuple | None = None  # the parameters and their versions at the last boundary
        self._fp32 = None
        self._stack: dict[int, list] = {}
        self._vstack: dict[int, list] = {}
        # Leaves that do not work in place lose their pre-hook once a recorded step has shown that
        # their forward leaves its inputs unchanged: the post-hook then takes the input flags.
        self._prunable: dict[int, tuple] = {}  # lid -> (pre-hook handle, own_in cell, module, hook)
        self._pruned: dict[int, tuple] = {}    # lid -> (module, hook, own_in cell): pre-hook removed
        self._probed: set[int] = set()    # prunable leaves whose pre-hook ran this step
        self._mutators: set[int] = set()  # leaves seen changing an input in place: keep their pre-hook
        self._restore: set[int] = set()   # pruned leaves whose input had changed since it was seen
        # Evaluation: the outermost watched call of a step that runs with gradients disabled once
        # training has started (validation under torch.no_grad()) is not recorded. ``_depth``: watched
        # module calls in progress (those whose pre-hook ran); ``_eval``: the lid of the outermost
        # call being skipped, or None.
        self._eval: int | None = None
        self._depth = 0
        self._sleepers: list[Any] = []  # handles of the hooks that only work on recorded steps
        self._asleep: list[tuple] | None = None  # (dict, key, hook, keys before it, keys after it)
        self.wgrad_rows = False  # weight-gradient rows recorded this step (see Session._end_step)
        self._leaf_hooks: list[Any] = []  # handles of gradient hooks on leaf tensors (see _grad_work)
        self._copies: dict[int, tuple] = {}  # id(gradient) -> its copy, this backward pass (see _grad_copy)
        self._copies_task = -2
        self._unarmed: list[tuple[list, Any]] = []  # hooks' traced calls not yet behind compiler.disable (see _eager)
        self._root_pre: Any = None  # the root's pre-hook (see enter_call_late)
        self._call_mark: Any = None  # Session.rows_mark() where the outermost call in progress began
        self._foreign = False  # run from a thread other than the session's training thread (see go_foreign)
        root, notes = unwrap_model(model)
        self.root = root
        self.prefix = session.prefix_for(root)  # "" for the first model, ``Class:`` for another
        self._compiled = any("torch.compile" in n for n in notes)
        for n in notes:
            session.note(n)
        self._all_modules = all_modules
        try:
            self._attach(root, all_modules)
        except BaseException:  # (a module refused a hook): the hooks put on so far go, as if watch() never ran
            for h in self._sleepers + self._handles:
                h.remove()
            raise
        self.snapshot_grads()
        self._screen_weights()
        session.attach(self)
        self.sleep(not session.recording)
        if session.config.force_fp32:
            self._force(session.config.force_fp32)
        _WATCHED[root] = self

    # -- hooks -----------------------------------------------------------------------------
    def _attach(self, root: nn.Module, all_modules: bool) -> None:
        s = self.session
        ids: dict[int, int] = {}
        seen_params: set[int] = set()
        # a part of this model that another watch records keeps that watch: its layers are not recorded twice
        others = [w for w in list(_WATCHED.values()) if not w._removed and w.root is not root]
        theirs = {id(m): w for w in others for m in w.root.modules()}
        scripted: set[int] = set()  # TorchScript modules and what they hold: no Python hooks there
        self._tree = []  # (module._modules, its children) of each module that has any: see tree_changed
        for name, mod in root.named_modules():
            if id(mod) in scripted:
                continue
            if isinstance(mod, _ScriptModule):
                scripted.update(id(m) for m in mod.modules())
                s.note(f"{self.prefix + name} ({_script_kind(mod)}) is a TorchScript module (torch.jit.script or "
                       "torch.jit.trace): hooks cannot be put on it, so it and its submodules are not recorded. "
                       "Watch the model before scripting that part to record it")
                continue
            if mod._modules:
                self._tree.append((mod._modules, tuple(mod._modules.values())))
            if id(mod) in theirs:
                if theirs[id(mod)].root is mod:
                    log.warning("ampdoctor: %s (%s) is watched on its own already: its layers stay recorded under "
                                "that watch's names, not this model's; remove() that watch before watch(model) to "
                                "record the whole model under one set of names", name, type(mod).__name__)
                continue
            full = self.prefix + name
            has_own_params = any(True for _ in mod.parameters(recurse=False))
            is_leaf = not any(True for _ in mod.children())
            parent_name = name.rpartition(".")[0] if name else None
            parent = ids.get(id(root.get_submodule(parent_name))) if parent_name is not None else None
            lid = s.new_layer(full, type(mod).__name__, is_leaf, parent)
            ids[id(mod)] = lid
            stats = all_modules or is_leaf or has_own_params
            inplace = _inplace(mod)
            own_in = [False]  # True once the post-hook takes the input flags itself (see prune_pre_hooks)
            prunable = is_leaf and not inplace
            pre_fn = self._make_pre(lid, inplace, prunable)
            pre = mod.register_forward_pre_hook(pre_fn, with_kwargs=True)
            if name == "":
                self._root_pre = pre_fn  # (see enter_call_late)
            self._sleepers.append(pre)
            if prunable:
                self._prunable[lid] = (pre, own_in, mod, pre_fn)
            # always_call: a forward that raises still ends its call (an evaluation that raised would
            # otherwise leave every later call of the step taken for part of it)
            self._sleepers.append(mod.register_forward_hook(self._make_post(lid, stats, own_in), with_kwargs=True,
                                                            always_call=True))
            if name == "" and s.config.oracle is not None:
                self._handles.append(mod.register_forward_hook(self._root_output_check()))
            if stats:
                for pname, p in mod.named_parameters(recurse=False):
                    if id(p) in seen_params:
                        continue  # tied weights: counted once, with their first owner
                    seen_params.add(id(p))
                    self._params.append((lid, pname, p))
                    self._owners.append((mod._parameters, pname))
        self._grads_seen = [None] * len(self._params)
        self._handles.extend(self._sleepers)

    def go_foreign(self) -> None:
        """This model runs in a thread other than the one whose training the session records (two
        models trained in two threads): the hooks are not thread-safe, so it is left alone from now on
        (its hooks return at once; the session no longer reads its weights), with a note."""
        if self._foreign:
            return
        self._foreign = True
        s = self.session
        try:
            s.watches.remove(self)
        except ValueError:
            pass
        name = type(self.root).__name__
        msg = (f"{name} runs in another thread than the model trained first: not recorded (the hooks record one "
               "training thread per process; train each model in a process of its own, or in one thread)")
        log.warning("ampdoctor: %s", msg)
        s.foreign_notes.append(msg)  # (written by the training thread: the trace's writer is not thread-safe)

    def _screen_weights(self) -> None:
        """Weights that are NaN/Inf already when the watch begins (a checkpoint saved after a run broke,
        a bad initialisation): a note, and the first non-finite value of the run (``at_start``), so the
        report does not take the first NaN output they give for an op that produced it. One reduction
        per parameter (no temporary copy) and one host read per device, once."""
        by_dev: dict[Any, list[tuple[int, torch.Tensor]]] = {}
        for lid, _, p in self._params:
            # (plain tensors only: a DTensor's reduction would be a collective)
            if p is not None and type(p.data) is _Tensor and p.is_floating_point() and p.numel() and \
                    p.layout == torch.strided and not p.is_meta:
                by_dev.setdefault(p.device, []).append((lid, p))
        bad: list[int] = []
        try:
            with torch.no_grad():
                for items in by_dev.values():
                    amax = torch.stack([torch.linalg.vector_norm(p.detach(), ord=math.inf).float() for _, p in items])
                    ok = torch.isfinite(amax).tolist()
                    bad.extend(lid for (lid, _), fine in zip(items, ok) if not fine)
        except Exception as e:  # pragma: no cover - never break watch() for a check
            log.info("ampdoctor: could not check the weights for NaN/Inf: %s: %s", type(e).__name__, e)
            return
        if not bad:
            return
        s = self.session
        lids = list(dict.fromkeys(bad))
        names = [s.layers[lid].name for lid in lids]
        shown = ", ".join(_shown_name(s.layers[lid]) for lid in lids[:5]) + (f" and {len(lids) - 5} more" if len(lids) > 5 else "")
        s.note(f"weights already NaN/Inf when watch() began, before any step: {shown} (a checkpoint saved after "
               "the run broke, or a bad initialisation): fix them first; what they give is not a precision problem")
        s.writer.add_event(s.step, "first_nonfinite", names[0], kind="weight", call=0, producers=len(lids), at_start=True)
        s.writer.commit()

    def enter_call_late(self, module: nn.Module, args: Any) -> None:
        """The root's pre-hook, by hand, for the call of ``module`` (the root) that is going on while this
        watch was made (``ampdoctor run``'s automatic watch, made in a global pre-hook of that call, after
        torch took the module's own pre-hooks): its post-hook then ends a call that it saw begin, not one
        begun before the step boundary. (That call's keyword inputs are not seen.)"""
        pre = self._root_pre
        if pre is not None and module is self.root and not self._removed:
            pre(module, args, {})

    def tree_changed(self) -> bool:
        """Whether a submodule was replaced, removed or added since the hooks were attached
        (``resize_token_embeddings``, a new head, LoRA layers swapped in)."""
        for d, kids in self._tree:  # (modules compare by identity; a module that had none never gets one here)
            if tuple(d.values()) != kids:
                return True
        return False

    def reattach(self) -> None:
        """Hooks on the model as it is now (see :meth:`tree_changed`): the old ones go, the layers that
        kept their names keep their rows' names."""
        asleep = self._asleep is not None
        for h in self._handles:
            h.remove()
        self._handles, self._sleepers, self._asleep = [], [], None
        self._prunable.clear()
        self._pruned.clear()
        self._probed.clear()
        self._mutators.clear()
        self._restore.clear()
        self._params, self._owners = [], []
        self._attach(self.root, self._all_modules)
        self.snapshot_grads()
        if asleep:
            self.sleep(True)

    def sleep(self, asleep: bool) -> None:
        """Take the module hooks out of their dicts for steps that are not
        recorded (they would return at once, but a module with any hook takes PyTorch's slower
        call path), and put them back, in their places, before a recorded step. Not under
        torch.compile: dynamo guards on the hook dicts and would recompile at each change."""
        if self._removed:
            return
        self._eval, self._depth = None, 0  # (a call that raised never reached its forward hook)
        if self._compiled:
            asleep = False  # compiled (maybe seen only now): awake for good
        if asleep == (self._asleep is not None):
            return
        if asleep:
            self._asleep = []
            for h in self._sleepers:
                d = h.hooks_dict_ref()
                if d is not None and h.id in d:
                    keys = list(d)
                    i = keys.index(h.id)
                    self._asleep.append((d, h.id, d.pop(h.id), set(keys[:i]), set(keys[i + 1:])))
            return
        for d, key, hook, before, after in self._asleep:
            # ours goes back right after the hooks that ran before it: the hooks registered after ours,
            # also those registered while it slept, run after it again, in their order; hooks prepended
            # meanwhile (``prepend=True``: ahead of every hook there when it slept) stay in front
            keys = list(d)
            first_old = next((i for i, k in enumerate(keys) if k in before or k in after), 0)
            d[key] = hook
            for k in keys[first_old:]:
                if k not in before:
                    d.move_to_end(k)
        self._asleep = None

    def _grad_work(self, t: torch.Tensor, entries: tuple) -> None:
        """Have ``entries`` done, in order, with ``t``'s gradient (see :class:`_GradWork`)."""
        hooks = t._backward_hooks
        if hooks:
            last = hooks[next(reversed(hooks))]
            if last.__class__ is _GradWork and last.watch is self._ref:
                last.add(entries)
                return
        work = _GradWork()
        work.watch = self._ref
        work.rows = False
        work.add(entries)
        if t.is_leaf:  # a parameter or a tensor the script made: it outlives the step, its hook must not
            # (dropped where the backward pass ends; a tensor that had no hook dict gets none back then)
            self._leaf_hooks.append((t.register_hook(work), _weakref(t) if hooks is None else None))
        elif type(t) is _Tensor:
            _new_hook(t, work)
        else:
            t.register_hook(work)

    def _grad_copy(self, grad: torch.Tensor, task: int) -> torch.Tensor:
        """A copy of ``grad``, for a gradient hook to measure instead of holding ``grad`` itself (why: see
        :func:`_layout_may_change`). Hooks of the same backward pass that get the same gradient share one copy."""
        copies = self._copies
        if self._copies_task != task:
            copies.clear()  # (weak references only: the batch holds the copies)
            self._copies_task = task
        key = id(grad)
        hit = copies.get(key)
        if hit is not None and hit[0]() is grad and hit[1] == grad._version:
            copy = hit[2]()
            if copy is not None:
                return copy
        with torch.no_grad():
            copy = grad.detach().clone()
        copies[key] = (_weakref(grad), grad._version, _weakref(copy))
        return copy

    def drop_leaf_hooks(self) -> None:
        """Remove the gradient hooks this watch put on leaf tensors (see :meth:`_grad_work`)."""
        hooks, self._leaf_hooks = self._leaf_hooks, []
        for h, had_none in hooks:
            h.remove()
            t = had_none() if had_none is not None else None
            if t is not None and not t._backward_hooks:
                t._backward_hooks = None

    def _in_flag(self, lid: int, key: tuple, args: Any, call: int, post: bool = False) -> tuple | None:
        """The slots of this call's floating inputs (their NaN/Inf flag), and an input-gradient
        flag request on those that need a gradient. ``post``: called after the forward (the leaf's
        pre-hook was pruned): an input changed in place since its slot was made may have been
        changed by this forward, so the pre-hook comes back from the next recorded step on."""
        s = self.session
        rows = s._rows
        changed = rows.changed
        if type(args) is tuple and len(args) == 1 and type(args[0]) is _Tensor:  # the common case
            t = args[0]
            flag = None
            if t.dtype.is_floating_point and t.layout == _strided and not t.is_meta:
                try:
                    if t.numel():
                        flag = (rows.slot_of(t, key, None, True, 0 if post else HOLD_CALL),)
                    if t.requires_grad:
                        self._grad_work(t, ((True, lid, "gin", call),))
                except Exception as e:  # pragma: no cover - as Session.flag_slots
                    s.note_layer(lid, f"could not check in for NaN/Inf: {type(e).__name__}: {e}")
        else:
            ins = _float_inputs(args)
            flag = s.flag_slots(lid, "in", ins, 0 if post else HOLD_CALL)
            for t in ins:
                if t.requires_grad:
                    self._grad_work(t, ((True, lid, "gin", call),))
        if post and rows.changed != changed:
            self._restore.add(lid)
        return flag

    def _make_pre(self, lid: int, inplace: bool, probe: bool):
        s = self.session
        stack: list = []
        vstack: list = []
        layer = s.layers[lid]
        in_flag = self._in_flag
        in_key = ((lid, "flag", "in"), 0)
        probed = self._probed

        def pre(mod: nn.Module, args: Any, kwargs: dict) -> None:
            if _is_compiling():
                return traced[0](mod, args, kwargs)
            if not s.recording or self._removed or self._foreign or _graph_task_id() != -1 or _inference_mode():
                return  # (inference tensors have no version counter: evaluation under inference_mode is not recorded)
            if self._eval is not None:
                return  # inside an evaluation call
            if not self._depth:  # an outermost call
                if not s.claim_thread():
                    return self.go_foreign()  # another thread trains the watched model(s): this one is left alone
                if s.eval_call(mod):
                    self._eval = lid  # gradients disabled (or model.eval()) after training started: evaluation
                    return
                s.last_mode = mod.training
                if _functorch_level() is not None:
                    self._eval = lid  # inside vmap/grad: not recorded, as an evaluation call is not, but the
                    s._active = True  # step did work (its optimizer step ends it)
                    s.note_layer(lid, _FUNCTORCH_NOTE)
                    return
                if not s.trained:
                    s.outermost_call(_grad_enabled())  # before any backward: is it evaluation? (Session.outermost_call)
                    if s.fmt_defaulted and not s.step:
                        s.recheck_format(self.root)
                self._call_mark = s.rows_mark()  # what its rows start from, should it raise
            if s._fmt_auto:  # the first watched forward: the run's format, if none was given (see resolve_format)
                s.resolve_format(self.root, final=False)
            self._depth += 1
            if layer.ord is None:
                s.mark_order(lid)
            if kwargs:  # (keyword inputs, as in model(input_ids=..., inputs_embeds=...), are inputs too)
                args = (args, kwargs)
            if probe:  # does this leaf change its inputs in place? (see prune_pre_hooks)
                probed.add(lid)
                if type(args) is tuple and len(args) == 1 and type(args[0]) is _Tensor:
                    vstack.append(((args[0], args[0]._version),))
                else:
                    vstack.append([(t, t._version) for _, t in iter_tensors(args)])
            if s.attributing:
                stack.append(in_flag(lid, in_key, args, s._calls.get(lid, 0)))
            if inplace:
                s.flush_rows()  # measure the waiting tensors before this module overwrites its input

        traced = self._eager(pre)
        self._stack[lid] = stack  # type: ignore[attr-defined]
        self._vstack[lid] = vstack
        return self._guard(pre)

    def prune_pre_hooks(self) -> None:
        """At the end of a recorded step: leaves (not ``inplace``) whose pre-hook ran and whose
        forward changed none of its tensor inputs in place lose their pre-hook; their post-hook takes
        the input flags from then on (one hook call a module call instead of two). Not under
        torch.compile (dynamo guards on the hook dicts). A pruned leaf whose input was found changed
        since it was last seen gets its pre-hook back (at the end of its module's pre-hooks), for
        good."""
        probed, self._probed = self._probed, set()
        restore, self._restore = self._restore, set()
        if self._removed:
            return
        for lid in restore:
            got = self._pruned.pop(lid, None)
            if got is None:
                continue
            mod, fn, own_in = got
            handle = mod.register_forward_pre_hook(fn, with_kwargs=True)
            self._sleepers.append(handle)
            self._handles.append(handle)
            own_in[0] = False
            self._mutators.add(lid)
        if self._compiled or not probed:
            return
        drop = []
        for lid in probed:
            self._vstack[lid].clear()  # (a forward that raised leaves its entry)
            if lid in self._mutators or lid not in self._prunable:
                continue
            handle, own_in, mod, fn = self._prunable.pop(lid)
            handle.remove()
            own_in[0] = True
            self._pruned[lid] = (mod, fn, own_in)
            drop.append(handle)
        if drop:
            gone = set(map(id, drop))
            self._sleepers = [h for h in self._sleepers if id(h) not in gone]
            self._handles = [h for h in self._handles if id(h) not in gone]

    def _make_post(self, lid: int, record_stats: bool, own_in: list):
        s = self.session
        stack = self._stack[lid]
        vstack = self._vstack[lid]
        grad_work = self._grad_work
        in_flag_of = self._in_flag
        layer = s.layers[lid]
        in_key = ((lid, "flag", "in"), 0)
        out_key = ((lid, "flag", "out"), 0)
        act_key = (lid, "activation", "out")

        def post(mod: nn.Module, args: Any, kwargs: dict, out: Any) -> None:
            if _is_compiling():
                return traced[0](mod, args, kwargs, out)
            if not s.recording or self._removed or self._foreign or s.closed or _graph_task_id() != -1 or _inference_mode():
                return  # (a forward inside backward is activation checkpointing recomputing it)
            if self._eval is not None:  # inside an evaluation call (see the pre-hook)
                if self._eval == lid:
                    self._eval = None
                return
            if not own_in[0]:  # its pre-hook ran (not pruned): this call is over
                self._depth -= 1
                if self._depth < 0:  # a call that began before the step boundary (its own optimizer step:
                    self._depth = 0  # Lightning's training_step through the DDP wrapper): that step is written,
                    stack.clear()    # and what its pre-hook held belonged to it; the output is not recorded
                    vstack.clear()
                    if s._fmt_auto:
                        s.resolve_format(self.root)
                    if record_stats:
                        s.note_layer(lid, _SPANNED_NOTE)
                    return
                if out is None and _exc_info()[0] is not None:  # its forward raised (always_call): no output,
                    if vstack:  # not a call; what its pre-hook left goes
                        vstack.pop()
                    if stack and s.attributing:
                        held = stack.pop()
                        if held is not None:
                            s._rows.release(held)
                    if not self._depth and self._call_mark is not None:
                        # the outermost call raised (a bad batch skipped, an OOM retried): the rows and
                        # calls of the modules that finished inside it go too, not into the step
                        s.drop_rows_since(self._call_mark)
                        self._call_mark = None
                    return
                if not self._depth and s._fmt_auto:  # the first watched forward ends: no autocast seen in it
                    s.resolve_format(self.root)
            elif out is None and _exc_info()[0] is not None:
                return
            alone = self._depth <= 0 and own_in[0]  # a leaf called on its own (its pre-hook pruned)
            if s.trained and not _grad_enabled():
                if alone:
                    return  # a leaf called on its own with gradients disabled after training started: evaluation
                if record_stats:
                    s.note_layer(lid, _NO_GRAD_NOTE)
            elif alone:
                if s.eval_call(mod):
                    return  # (in eval mode, see Session.eval_call)
                s.last_mode = mod.training
            s._active = True  # this module's call number this step
            calls = s._calls
            call = calls.get(lid, 0)
            calls[lid] = call + 1
            if layer.ord is None:
                s.mark_order(lid)
            if vstack:  # the pre-hook's probe: did this forward change an input in place?
                for t, v in vstack.pop():
                    if t._version != v:
                        self._mutators.add(lid)
            rows = s._rows
            in_flag = None
            if s.attributing:  # the input flags: from the pre-hook, or here once it is gone
                in_flag = (in_flag_of(lid, in_key, (args, kwargs) if kwargs else args, call, True) if own_in[0] else
                           stack.pop() if stack else None)
                if in_flag is not None:  # held (since the pre-hook, or as a container's output): the
                    rows.release(in_flag)  # outputs come next, with no flush before them
            if type(out) is _Tensor and out.dtype.is_floating_point and out.layout == _strided and not out.is_meta:
                # the common case, one floating tensor: the same work as below, inline, and one hook
                # request for both gradient entries
                try:
                    n = out.numel()
                    slot = -1
                    gout = None
                    if s.attributing:
                        if in_flag is not None:
                            s._flags.append(in_flag)
                            s._flag_meta.append((lid, call, "in"))
                        if n:
                            slot = rows.slot_of(out, out_key, None, not record_stats, 0 if record_stats else HOLD_CALL)
                            s._flags.append((slot,))
                            s._flag_meta.append((lid, call, "out"))
                        if out.requires_grad:
                            gout = (True, lid, "gout", call)
                    if record_stats:
                        nbytes = n * out.element_size()
                        if slot < 0:
                            slot = rows.slot_of(out, act_key, nbytes)
                        rows.meta.append((lid, "activation", "out", call, _dtype_name(out.dtype), n, nbytes))
                        rows.slots.append(slot)
                        if out.requires_grad:
                            grad_work(out, ((False, lid, "out", call),) if gout is None else (gout, (False, lid, "out", call)))
                            return
                    if gout is not None:
                        grad_work(out, (gout,))
                except Exception as e:  # never break the user's forward because of a statistic
                    s.note_layer(lid, f"could not record activation out: {type(e).__name__}: {e}")
                return
            outs = _float_outputs(out)
            if s.attributing:
                if in_flag is not None:
                    s.add_flag(lid, call, "in", in_flag)
                out_flag = s.flag_slots(lid, "out", [t for _, t in outs], HOLD_CALL)
                if out_flag is not None:
                    s.add_flag(lid, call, "out", out_flag)
                for _, t in outs:
                    if t.requires_grad:
                        grad_work(t, ((True, lid, "gout", call),))
            if not record_stats:
                return
            if not outs:
                if not any(True for _ in iter_tensors(out)) and out is not None and not isinstance(out, torch.Tensor):
                    s.note_layer(lid, f"output of type {type(out).__name__} holds no tensor: nothing recorded")
                elif any(t.is_meta for _, t in iter_tensors(out)):
                    s.note_layer(lid, "output on the meta device (it holds no values): nothing recorded")
                elif out is not None:
                    s.note_layer(lid, "no floating-point output: nothing recorded")
                return
            for slot, t in outs:
                s.add_stats(lid, "activation", slot, call, t)
                if t.requires_grad:
                    grad_work(t, ((False, lid, slot, call),))

        traced = self._eager(post)
        return self._guard(post)

    def _root_output_check(self):
        """Trials only: a device flag, every step, of whether the model's output held NaN/Inf, so a
        script that raises on a NaN loss before backward is still seen to have broken (no sync)."""
        s = self.session

        def post(mod: nn.Module, args: Any, out: Any) -> None:
            if _is_compiling():
                return traced[0](mod, args, out)
            if self._removed or self._foreign or s.closed or _in_backward() or s.eval_call(mod):
                return  # (an evaluation call's output says nothing of training)
            flag = _nonfinite_flag([t for _, t in floating(iter_tensors(out)) if t.numel()])
            if flag is not None:
                s.last_output_nonfinite = (s.step, flag)

        traced = self._eager(post)
        return self._guard(post)

    # Under torch.compile, dynamo must stay out of our hooks: it would trace them, guard on the
    # session's state and recompile every step. Each hook starts with ``_is_compiling()`` and, when
    # traced, hands its call to ``_eager(hook)``: the same hook run eagerly, which marks the watch
    # compiled (its hooks then stay put: no sleeping between recorded steps, whose hook changes
    # would recompile too). A model compiled before ``watch()`` gets hooks disabled for dynamo.
    def _eager(self, fn) -> list:
        """``[hook]`` for ``fn``'s call when dynamo traces it: the same hook run eagerly, which marks the
        watch compiled, behind ``torch.compiler.disable``. That import of dynamo takes about a second
        (and adds sympy's warnings filter), so a watch made before dynamo is imported wraps its hooks
        only when ``torch.compile`` is first called (:meth:`arm`, from the step tracker's patch)."""
        watch = self

        def eager(*args: Any) -> Any:
            watch._compiled = True
            return fn(*args)

        box = [eager]
        if _disable is not None:
            if "torch._dynamo" in sys.modules:
                box[0] = _disable(eager)
            else:
                self._unarmed.append((box, eager))
        return box

    def hook_handles(self) -> list[Any]:
        """The handles of this watch's module hooks (awake or asleep)."""
        return self._handles

    def arm(self) -> None:
        """``torch.compile`` is about to be called: the hooks' traced calls go behind
        ``torch.compiler.disable`` (see :meth:`_eager`)."""
        todo, self._unarmed = self._unarmed, []
        for box, eager in todo:
            box[0] = _disable(eager)

    def _guard(self, fn):
        return _disable(fn) if self._compiled and _disable is not None else fn

    def snapshot_grads(self) -> None:
        """Remember each parameter's ``.grad`` as it is now (the object and its ``_version``), so
        that :meth:`record_weight_grads` knows which gradients a backward pass has changed since."""
        if self._removed:
            return
        self._sync_params()
        seen = self._grads_seen
        for i, (_, _, p) in enumerate(self._params):
            g = None if p is None else p.grad
            seen[i] = None if g is None else (_weakref(g), g._version)

    def _sync_params(self) -> None:
        """The parameters as their modules hold them now: one replaced (``module.weight =
        nn.Parameter(...)``) is read where it is now, not the old object; one set to None is skipped."""
        ps = self._params
        for i, (d, name) in enumerate(self._owners):
            p = d.get(name)
            if p is not ps[i][2]:
                ps[i] = (ps[i][0], name, p)
                self._grads_seen[i] = None

    def record_weight_grads(self) -> None:
        """Rows of the weight gradients accumulated since the last look (a new ``.grad``, or one
        changed in place), measured together: called where each backward pass ends, before anything
        (``GradScaler.unscale_``, clipping, the next micro-batch) changes them in place. One pass over
        the parameters instead of a post-accumulate-grad hook per parameter."""
        if self._removed:
            return
        self._sync_params()
        seen = self._grads_seen
        changed = []
        for i, (lid, pname, p) in enumerate(self._params):
            g = None if p is None else p.grad
            if g is None:
                seen[i] = None
                continue
            last = seen[i]
            ver = g._version
            if last is not None and last[1] == ver and last[0]() is g:
                continue
            seen[i] = (_weakref(g), ver)
            changed.append((lid, pname, g))
        if changed:
            self.wgrad_rows = True
            self.session.add_param_rows("weight_grad", changed)

    def record_weights(self, rows: Any = None) -> None:
        """Weights after the optimizer step, into this step's rows or ``rows`` (a step that has ended:
        see :meth:`Session._end_step`)."""
        if not self._removed:
            self._sync_params()
            ps = self._params
            self.session.add_param_rows("weight", ps if all(e[2] is not None for e in ps) else
                                        [e for e in ps if e[2] is not None], rows)

    def mark_weights(self) -> None:
        """Remember the parameters and their ``_version`` now (the step boundary), for
        :meth:`weights_changed`: the weights' rows are read later, when the next backward starts."""
        self._marked = None
        if not self._removed:
            self._sync_params()
            ps = [e[2] for e in self._params]
            self._marked = (ps, [None if p is None else p._version for p in ps])

    def weights_changed(self) -> bool:
        """Whether a parameter was changed in place or replaced since :meth:`mark_weights` (read
        after :meth:`record_weights`, which has brought the parameters up to date)."""
        marked, self._marked = self._marked, None
        if marked is None or self._removed:
            return False
        ps, vs = marked
        return any(e[2] is not p or (p is not None and p._version != v) for e, p, v in zip(self._params, ps, vs))

    def _force(self, names: list[str]) -> None:
        from .precision import force_fp32
        p = self.prefix  # another model's names (``D:net.2`` is not this model's ``net.2``) are not ours
        mine = [n[len(p):] for n in names if n.startswith(p)] if p else names
        known = {n for n, _ in self.root.named_modules()}
        take = [n for n in mine if n in known]
        if take:
            self._fp32 = force_fp32(self.root, take)
            log.info("ampdoctor: running in FP32: %s", ", ".join(take))

    # -- the handle ------------------------------------------------------------------------
    def _detach_hooks(self, unforce: bool = True) -> None:
        """Take every hook out. ``unforce``: also undo what the trial forced to FP32 (not in a forked
        child, where that would write a copy of every forced parameter: see ``session._forked``)."""
        if self._removed:
            return
        self._removed = True
        self._asleep = None  # asleep: already out of their dicts
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.drop_leaf_hooks()
        self._sleepers.clear()
        self._prunable.clear()
        self._pruned.clear()
        if self._fp32 is not None and unforce:
            self._fp32.remove()
            self._fp32 = None
        if _WATCHED.get(self.root) is self:
            del _WATCHED[self.root]

    def remove(self, _exc: BaseException | None = None) -> None:
        """Remove every hook and patch this watch added and, if it was the last watch, flush the
        session's last step and close its trace; otherwise write what the session recorded so far,
        as :meth:`report` does (either way it syncs with the device). Safe to call twice."""
        if self._removed:
            return
        if not self.session.closed:
            self.session.settle_boundary()  # this watch's weights of the step that ended last
        self._detach_hooks()
        self.session.detach(self, _exc)
        self.session.write_out()  # (other watches go on recording: what is recorded so far is readable now)

    @property
    def trace_path(self):
        return self.session.trace_path

    def report(self, **kwargs: Any):
        """The per-layer report of what was recorded so far (flushes the trace first)."""
        from .report import build_report
        if self.session.trace_path is None:  # (a deferred trace, see Session.__init__: asked for, it is made now)
            self.session.writer.start()
        self.session.write_out()
        return build_report(self.trace_path, **kwargs)

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.remove(exc)  # (a crash, Ctrl-C or sys.exit inside the with: the trace says how the run ended)

    def __repr__(self) -> str:
        state = "removed" if self._removed else "active"
        return f"<ampdoctor.Watch {type(self.root).__name__} {state} trace={self.trace_path}>"


def watch(model: nn.Module, *, format: str | None = None, every: int | None = None, trace: str | None = None,
          all_modules: bool | None = None) -> Watch:
    """Record per-layer statistics of ``model`` against ``format`` (``"fp16"``, ``"bf16"``,
    ``"fp8_e4m3fn"``, ``"fp8_e5m2"``, ``"fp32"``) every ``every`` steps, into the SQLite ``trace``.
    Without ``format`` (or ``"auto"``) it is the format the run trains in, read in the first
    watched forward: autocast's dtype (also where the model's own ``forward`` enters it), else the
    parameters' fp16/bf16 dtype, else fp16.

    Under ``ampdoctor run``/``bisect`` the CLI's configuration wins over these arguments (the
    trial decides what is forced to FP32, the step budget and the trace path). Calling it on a
    model that is already watched returns the existing handle. Syncs with the device once, as it
    begins (the weights' NaN/Inf check: one host read per device), and never after.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"ampdoctor.watch expects a torch.nn.Module, got {type(model).__name__}; "
                        "pass the model you train (the object whose forward you call)")
    if every is not None and (not isinstance(every, int) or every < 1):
        raise ValueError(f"every must be a positive int, got {every!r}")
    if format is not None:
        from .formats import AUTO, get_format
        if str(format).lower() != AUTO:
            get_format(format)  # validate before any work
    root, _ = unwrap_model(model)
    if isinstance(root, _ScriptModule):
        raise TypeError(f"ampdoctor.watch cannot record a TorchScript model ({_script_kind(root)} made by torch.jit.script "
                        "or torch.jit.trace): hooks cannot be put on it. Watch the nn.Module itself, before scripting "
                        "it (train it unscripted while you debug)")
    existing = _WATCHED.get(root)
    if existing is not None and not existing._removed:
        log.info("ampdoctor: %s is already watched; returning the existing handle", type(root).__name__)
        _say_ignored(existing.session, format, every, trace)
        return existing
    for other in list(_WATCHED.values()):
        if not other._removed and any(m is root for m in other.root.modules()):
            log.info("ampdoctor: %s is part of the watched %s, which records its layers; returning that handle",
                     type(root).__name__, type(other.root).__name__)
            _say_ignored(other.session, format, every, trace)
            return other
    session = get_session(format=format, every=every, trace=trace, all_modules=all_modules)
    _say_ignored(session, format, every, trace)
    all_mods = session.config.all_modules if all_modules is None else all_modules
    try:
        return Watch(model, session, all_modules=all_mods)
    except BaseException:
        if not session.watches and not session.owned:  # the session this call began goes with it
            session.close("crashed", error="watch() failed")
        raise


def _say_ignored(session: Session | None, format: str | None, every: int | None, trace: Any) -> None:
    """Warn about the arguments of a watch() that joins a session which runs otherwise (one session,
    and one trace, per process; the CLI's configuration wins without a word)."""
    if session is None or session.owned:
        return
    for key, value in (("format", format), ("every", every)):
        if value is not None and str(getattr(session.config, key)).lower() != str(value).lower():
            log.warning("ampdoctor: this process's watch already uses %s=%r; ignoring %s=%r (remove() the other "
                        "watches first to start anew)", key, getattr(session.config, key), key, value)
    if trace is not None and session.trace_path is not None and \
            os.path.abspath(os.fspath(trace)) != os.path.abspath(os.fspath(session.trace_path)):
        log.warning("ampdoctor: this process already records to %s (one trace per process); ignoring trace=%r: "
                    "remove() the other watches first to start a new trace", session.trace_path, os.fspath(trace))


def watched_root(module: nn.Module) -> Watch | None:
    return _WATCHED.get(module)
