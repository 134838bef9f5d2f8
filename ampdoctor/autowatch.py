"""Zero-code-change watching: a global module forward pre-hook that watches the first
top-level module with parameters (the model) when the script never calls ``watch()`` itself."""

from __future__ import annotations

import logging
import sys
import warnings
from typing import Any

import torch.optim.optimizer as _optim_mod
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook

from .session import Session
from .steps import closure_given

log = logging.getLogger(__name__)


def _in_construction(module: nn.Module) -> bool:
    """Whether this call runs while a model is being built, not trained: inside an ``nn.Module``'s
    ``__init__`` (``n = self.features(torch.zeros(1, 3, 32, 32)).numel()`` to size the next layer), or a
    parametrization evaluated as it is registered (``spectral_norm(layer)`` calls its
    ``ParametrizationList``). The model is the module called after that, whose names users see."""
    if type(module).__name__ == "ParametrizationList" and type(module).__module__.startswith("torch.nn.utils"):
        return True
    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_name == "__init__" and isinstance(f.f_locals.get("self"), nn.Module):
            return True
        f = f.f_back
    return False


_COMPILE_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks"


class AutoWatch:
    def __init__(self, session: Session):
        self.session = session
        self._known: set[int] = set()
        self._roots: list[Any] = []
        self._handle = register_module_forward_pre_hook(self._pre)
        # an optimizer.step(closure) in progress (LBFGS) when the model's first call, inside the closure,
        # starts the watch: the session's own step hooks came too late to see it begin
        self._closure_step = False
        self._opt_handles = [_optim_mod.register_optimizer_step_pre_hook(self._opt_pre),
                             _optim_mod.register_optimizer_step_post_hook(self._opt_post)]
        # torch warns at every call of a torch.compile'd module while a global module hook exists: that
        # hook is this one (it sees the wrapper and the model it wraps, and watches the model once)
        warnings.filterwarnings("ignore", message=_COMPILE_WARNING, category=UserWarning)
        self._filter = warnings.filters[0]

    def _opt_pre(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        self._closure_step = closure_given(args, kwargs)

    def _opt_post(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        self._closure_step = False

    def _pre(self, module: nn.Module, args: Any) -> Any:
        if id(module) in self._known or self.session.closed:
            return
        from .watch import Watch, unwrap_model, watched_root

        root, _ = unwrap_model(module)
        w = watched_root(root)
        if w is None:
            for other in self.session.watches:
                if any(m is module for m in other.root.modules()):
                    w = other
                    break
        if w is not None:
            self._known.update(id(m) for m in w.root.modules())
            self._known.add(id(module))
            return
        if next(module.parameters(), None) is None:
            self._known.add(id(module))  # loss functions and other parameter-free callables
            return
        if _in_construction(module):
            return  # not the model yet: a part of it run while it is built (not marked known: watched later)
        w = Watch(module, self.session, all_modules=self.session.config.all_modules)
        prefix = w.prefix
        self._roots.append(w)
        self._known.update(id(m) for m in root.modules())
        self._known.add(id(module))
        log.info("ampdoctor: watching %s automatically%s", type(root).__name__, f" as {prefix}" if prefix else "")
        w.enter_call_late(module, args)  # this first call is past the root's own pre-hooks
        if self._closure_step:
            self.session.closure_step_began()
        if w._fp32 is not None and module is root:
            # this first call is past the root's own pre-hooks: force it by hand (pure .half() models
            # need their inputs cast to float32 right now, since the parameters already are)
            return w._fp32.enter_call_late(module, args)
        return None

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        for h in self._opt_handles:
            h.remove()
        self._opt_handles = []
        if self._filter is not None:
            try:
                warnings.filters.remove(self._filter)
            except ValueError:  # the script reset the filters itself
                pass
            mutated = getattr(warnings, "_filters_mutated", None) or getattr(warnings, "_filters_mutated_lock_held", None)
            if mutated is not None:
                mutated()  # (the warnings module caches the filters' version)
            self._filter = None
