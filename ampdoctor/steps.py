"""Step tracking: the loss, the GradScaler's scale and skipped steps, optimizer steps.

While at least one watch is active, these are patched or hooked, and all are undone by
:meth:`StepTracker.uninstall` (the process is exactly as before):

* ``torch.autograd.backward`` is wrapped to see the loss (the root of ``loss.backward()``) and an
  exception the backward pass raised, and
  ``torch.autograd.grad`` to see a scaled loss that only makes gradients for a penalty (the AMP
  recipe's gradient penalty), which is then not the step's loss;
* ``GradScaler.scale`` / ``GradScaler.step`` / ``GradScaler.update`` (``torch.amp`` and the
  deprecated ``torch.cuda.amp`` class when it defines its own) are wrapped to see the unscaled
  loss, the optimizers stepped (also a step the scaler skips), the scale before and after
  ``update()`` and so whether the step was skipped, and so are those of
  every subclass that defines its own: the ones that exist, and through
  ``GradScaler.__init_subclass__`` those created while the watch is on;
* ``nn.Module.__getstate__`` is wrapped to leave the watches' module hooks out of the state that
  ``torch.save(model)``, ``pickle`` and ``copy.deepcopy(model)`` take (a checkpoint loads without
  ampdoctor, a copy such as an EMA model is not recorded as the original);
* ``torch.compile`` is wrapped to tell the watches before it runs (they put their hooks' traced
  calls behind ``torch.compiler.disable`` then, rather than import dynamo at ``watch()``);
* a global optimizer step post-hook counts optimizer steps.

None of the wrappers syncs with the GPU: they keep device tensors for the session to read.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import types
from typing import Any, Callable

import torch
import torch.optim.optimizer as _optim_mod

log = logging.getLogger(__name__)


def _scaler_roots() -> list[type]:
    """``torch.amp.GradScaler``, and the deprecated ``torch.cuda.amp`` one where it is not its subclass."""
    roots: list[type] = []
    for mod in (torch.amp, getattr(torch.cuda, "amp", None)):
        cls = getattr(mod, "GradScaler", None) if mod is not None else None
        if isinstance(cls, type) and not any(issubclass(cls, r) for r in roots):
            roots.append(cls)
    return roots


def _scaler_classes() -> list[type]:
    """The GradScaler classes and their subclasses known now: a subclass with its own ``scale`` or
    ``update`` (FSDP's ``ShardedGradScaler`` defines both, without calling the base class's) would
    otherwise go unseen: its scaled loss taken for the loss, no scale, no skipped steps."""
    classes = _scaler_roots()
    i = 0
    while i < len(classes):
        try:
            subs = type.__subclasses__(classes[i])
        except TypeError:  # pragma: no cover
            subs = []
        classes.extend(c for c in subs if c not in classes)
        i += 1
    return classes


def closure_given(args: tuple, kwargs: dict) -> bool:
    """An optimizer step pre-hook's ``(args, kwargs)`` (the optimizer first) hold a closure (LBFGS)."""
    return callable(args[1] if len(args) > 1 else kwargs.get("closure"))


def _notify_first(orig: Callable, notify: Callable[[Any], None], arg: str | None = None) -> Callable:
    """``orig``, wrapped to call ``notify`` with its first argument (given by position, or by the
    keyword ``arg``) before it runs. (Callers pass a lambda that looks the sink's method up at each
    call, as a replaced method is then seen.)"""

    @functools.wraps(orig)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        notify(args[0] if args else kwargs.get(arg) if arg else None)
        return orig(*args, **kwargs)

    return wrapper


def _backward_wrapper(orig: Callable, sink: Any) -> Callable:
    """``torch.autograd.backward`` (what ``loss.backward()`` calls), wrapped to tell ``sink`` its root
    before it runs and the exception it raised, if any (a custom autograd Function's backward, a shape
    mismatch), which is raised on unchanged."""

    @functools.wraps(orig)
    def backward(*args: Any, **kwargs: Any) -> Any:
        sink.on_backward(args[0] if args else kwargs.get("tensors"))
        try:
            return orig(*args, **kwargs)
        except Exception as e:
            sink.on_backward_error(e)
            raise

    return backward


def _exit_wrapper(orig: Callable, sink: Any) -> Callable:
    """``os._exit``, wrapped to end ``sink``'s trace first: it skips ``atexit``, which ends the trace
    of a watch never removed otherwise. ``multiprocessing`` ends a forked worker this way, and so do
    some launchers. Not in a process forked from this one (``session._forked`` undoes the patch
    there, and this checks the pid too)."""
    pid = os.getpid()

    @functools.wraps(orig)
    def _exit(n: int) -> None:
        if os.getpid() == pid:
            try:
                sink.on_hard_exit(n)
            except BaseException as e:  # noqa: BLE001 - the exit must happen
                log.warning("ampdoctor: could not end the trace at os._exit(): %s: %s", type(e).__name__, e)
        orig(n)

    return _exit


def _sys_exit_wrapper(orig: Callable, sink: Any) -> Callable:
    """``sys.exit``, wrapped to tell ``sink`` the status first: the ``SystemExit`` it raises ends the
    interpreter without leaving itself in ``sys.last_value``, so the exit handler that ends the trace
    of a watch never removed cannot see it (a ``sys.exit(7)`` was stamped "finished")."""

    @functools.wraps(orig)
    def exit(*args: Any) -> None:
        try:
            sink.on_sys_exit(args[0] if args else None)
        except Exception as e:  # noqa: BLE001 - the exit must happen
            log.warning("ampdoctor: could not note sys.exit(): %s: %s", type(e).__name__, e)
        orig(*args)

    return exit


_MISSING = object()
_RETIRED: list[_Patch] = []  # patches that were patched over when their watch ended (see _Patch)


def _heal() -> None:
    """Take out each retired patch that is back on top (the patch laid over it has ended)."""
    for patch in list(_RETIRED):
        if vars(patch.owner).get(patch.attr, _MISSING) is patch.new:
            patch.undo()
            _RETIRED.remove(patch)


class _Patch:
    """One attribute ampdoctor replaced, and how to put it back. A plain function is installed behind
    a guard: where the user (a ``mock.patch``, a profiler) patched the same attribute after ``watch()``,
    ``remove()`` leaves their patch in place rather than drop it, and ours, under it, calls the original
    from then on and takes itself out at its first call once their patch has put it back on top."""

    def __init__(self, owner: Any, attr: str, new: Any, tracker: StepTracker):
        self.owner, self.attr = owner, attr
        self.was_own = attr in vars(owner)
        self.original = vars(owner).get(attr) if self.was_own else None
        self.retired = False
        self.new = self._guarded(new) if isinstance(new, types.FunctionType) else new

    def _guarded(self, wrapper: Callable) -> Callable:
        fallback = self.original if self.was_own else getattr(self.owner, self.attr)
        patch = self

        @functools.wraps(wrapper)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if patch.retired:
                _heal()
                return fallback(*args, **kwargs)
            return wrapper(*args, **kwargs)

        return guarded

    def undo(self) -> None:
        if self.was_own:
            setattr(self.owner, self.attr, self.original)
        else:
            delattr(self.owner, self.attr)


class StepTracker:
    """Installs the patches and forwards what they see to ``sink`` (the session)."""

    def __init__(self, sink: Any):
        self._sink = sink
        self._saved: list[_Patch] = []
        self._opt_handle = None
        self._opt_pre_handle = None
        self._inside: set[tuple[int, str]] = set()  # (id(scaler), method) of wrapped calls in progress
        self.installed = False

    def install(self) -> None:
        if self.installed:
            return
        _heal()  # (an earlier watch's wrapper back on top goes first: not wrapped again)
        sink = self._sink
        self._patch(torch.autograd, "backward", _backward_wrapper(torch.autograd.backward, sink))
        self._patch(torch.autograd, "grad", _notify_first(torch.autograd.grad, lambda t: sink.on_autograd_grad(t), "outputs"))
        orig_getstate = torch.nn.Module.__getstate__

        def __getstate__(module: Any) -> Any:
            return sink.without_our_hooks(orig_getstate(module))

        self._patch(torch.nn.Module, "__getstate__", __getstate__)
        if getattr(torch, "compile", None) is not None:
            self._patch(torch, "compile", _notify_first(torch.compile, lambda _: sink.on_compile()))
        for cls in _scaler_classes():
            self._wrap_scaler(cls)
        for root in _scaler_roots():  # and those defined (or imported) from now on, as they are created
            self._patch(root, "__init_subclass__", self._on_subclass(root))
        self._opt_pre_handle = _optim_mod.register_optimizer_step_pre_hook(
            lambda opt, args, kwargs: sink.on_optimizer_step_begin(opt, args, kwargs))
        self._opt_handle = _optim_mod.register_optimizer_step_post_hook(
            lambda opt, args, kwargs: sink.on_optimizer_step(opt))
        if not getattr(sink, "owned", True):  # (the CLI's runner ends its own session at os._exit)
            self._patch(os, "_exit", _exit_wrapper(os._exit, sink))
            self._patch(sys, "exit", _sys_exit_wrapper(sys.exit, sink))
        self.installed = True

    def uninstall(self) -> None:
        if not self.installed:
            return
        for patch in reversed(self._saved):
            if vars(patch.owner).get(patch.attr, _MISSING) is patch.new:
                patch.undo()
            else:  # patched again over ours (a mock, a profiler): its patch may put ours back when it ends
                patch.retired = True
                _RETIRED.append(patch)
                log.info("ampdoctor: %s.%s was patched again after watch(); ampdoctor's wrapper under that patch now "
                         "calls the original and takes itself out once it is back on top",
                         getattr(patch.owner, "__name__", patch.owner), patch.attr)
        self._saved.clear()
        _heal()
        if self._opt_handle is not None:
            self._opt_handle.remove()
            self._opt_handle = None
        if self._opt_pre_handle is not None:
            self._opt_pre_handle.remove()
            self._opt_pre_handle = None
        self.installed = False

    def _patch(self, owner: Any, attr: str, new: Any) -> None:
        patch = _Patch(owner, attr, new, self)
        self._saved.append(patch)
        setattr(owner, attr, patch.new)

    def _wrap_scaler(self, cls: type) -> None:
        if "scale" in cls.__dict__:
            self._patch(cls, "scale", self._wrap_scale(cls.__dict__["scale"]))
        if "step" in cls.__dict__:
            self._patch(cls, "step", self._wrap_step(cls.__dict__["step"]))
        if "update" in cls.__dict__:
            self._patch(cls, "update", self._wrap_update(cls.__dict__["update"]))

    def _on_subclass(self, root: type) -> classmethod:
        """``root.__init_subclass__`` while installed: wraps each new subclass's own ``scale``,
        ``step`` and ``update`` (undone by :meth:`uninstall` with the rest), after what ``root`` did before."""
        own = vars(root).get("__init_subclass__")
        wrap = self._wrap_scaler

        tracker = self

        def __init_subclass__(cls: type, **kwargs: Any) -> None:
            if own is not None:
                own.__get__(None, cls)(**kwargs)
            else:
                super(root, cls).__init_subclass__(**kwargs)
            if tracker.installed:  # (not where a later patch kept ours on past remove(): see _Patch)
                wrap(cls)

        return classmethod(__init_subclass__)

    def _wrap_scale(self, orig: Callable) -> Callable:
        sink = self._sink
        inside = self._inside

        @functools.wraps(orig)
        def scale(scaler: Any, outputs: Any) -> Any:
            key = (id(scaler), "scale")
            if key in inside:  # a subclass's scale() calling the base class's: seen once
                return orig(scaler, outputs)
            inside.add(key)
            fresh = getattr(scaler, "_scale", False) is None  # its first scale(): it starts at init_scale now
            try:
                scaled = orig(scaler, outputs)
            finally:
                inside.discard(key)
            if getattr(scaler, "_enabled", True) and isinstance(outputs, torch.Tensor):
                sink.on_scaled_loss(scaler, outputs, scaled)
                init = getattr(scaler, "_init_scale", None)
                if fresh and isinstance(init, (int, float)):
                    sink.on_first_scale(float(init))
            return scaled

        return scale

    def _wrap_step(self, orig: Callable) -> Callable:
        sink = self._sink

        @functools.wraps(orig)
        def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            if getattr(scaler, "_enabled", True):
                sink.on_scaler_step(scaler, optimizer)
            return orig(scaler, optimizer, *args, **kwargs)

        return step

    def _wrap_update(self, orig: Callable) -> Callable:
        sink = self._sink
        inside = self._inside

        @functools.wraps(orig)
        def update(scaler: Any, new_scale: Any = None) -> Any:
            key = (id(scaler), "update")
            if not getattr(scaler, "_enabled", True) or key in inside:
                # GradScaler(enabled=False): the optimizer step ends it; a subclass's update() calling the
                # base class's: the outer call reports it
                return orig(scaler, new_scale)
            before = getattr(scaler, "_scale", None)
            before = before.detach().clone() if isinstance(before, torch.Tensor) else None
            inside.add(key)
            try:
                result = orig(scaler, new_scale)
            finally:
                inside.discard(key)
            after = getattr(scaler, "_scale", None)
            sink.on_scaler_update(scaler, before, after if isinstance(after, torch.Tensor) else None)
            return result

        return update
