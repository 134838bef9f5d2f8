"""Run chosen modules in FP32 inside a mixed-precision model, and undo it exactly.

:func:`keep_fp32` is the one-line fix ampdoctor recommends; :func:`force_fp32` is what a
bisect trial uses to force several modules by qualified name.

How it works (and why this way): two hooks per module, nothing written onto the module.

* a forward **pre-hook** (``with_kwargs=True``, prepended so it runs before the module's
  other pre-hooks) disables autocast for every device type where it is enabled, casts the
  module's low-precision floating inputs (args and kwargs, nested in tuples, lists and
  dicts) to float32, and upcasts any fp16/bf16/fp8 parameters and buffers of the module
  (and of its submodules, since their forward runs inside it) by changing ``tensor.data``,
  so the ``Parameter`` objects an optimizer holds stay the same (done once by
  ``keep_fp32`` and checked again at each call, in case the model was cast since);
* a forward **hook** (``with_kwargs=True, always_call=True``, prepended so the caller's
  autocast state is back before other forward hooks run) restores the autocast state and,
  where no autocast was active and the inputs were half precision (a pure ``.half()`` /
  ``.bfloat16()`` model), casts the floating outputs back to the input dtype (the parameters'
  original dtype when no input is floating, e.g. an Embedding's indices) so the rest
  of the model sees what it saw before. ``always_call`` makes it run even when ``forward``
  raises, so autocast is never left disabled.

While a forced module's forward runs, an autocast that code inside it enters stays off: a
wrapper that enters autocast *inside* ``forward`` (accelerate, hence HF ``Trainer(fp16=True)``,
replaces ``model.forward`` with one wrapped in ``torch.autocast``) would otherwise turn it back on
after the pre-hook turned it off. This is done by wrapping ``torch.autocast.__enter__`` while any
handle is active (the original is put back when the last one is removed); outside forced modules
the wrapper only calls the original.

The autocast state to restore lives on a per-thread stack in the handle, so a module that
is called several times per step, re-entered, or nested inside another forced module
pairs its enter and exit correctly. :meth:`Fp32Handle.remove` removes both hooks and puts
parameters and buffers back in their original dtype (same objects), is idempotent, and
the handle is a context manager. Handles that share a tensor (nested kept modules, a module kept
twice, a tied weight) count their holds on it: it goes back to its dtype when the last one is removed.

A half/bf16 parameter (or buffer) that a module outside the kept one also holds (tied embeddings:
GPT-2's ``lm_head.weight`` is ``wte.weight``) is not upcast, as that would change it for the other
module too: it keeps its dtype and stays tied, and for each call the pre-hook puts an FP32 copy
(``t.float()``, so the gradient flows back to it in its dtype) in its place in the module's
``_parameters``/``_buffers`` table, which the post-hook puts back (``torch.func.functional_call``'s
way). Such ties are found once per tensor from the tensors' referrers (``keep_fp32`` is not given
the model); :func:`force_fp32` (``tied="upcast"``) upcasts instead and forces the partner module too.

Limits: optimizer state created before the upcast keeps its old dtype, so call
``keep_fp32`` before building the optimizer of a pure half-precision model. Float64 inputs
are left as they are (forcing never lowers precision). ``remove()`` puts a tensor back to the
dtype it last had before being upcast, and leaves one the user cast since (``model.double()``)
as it is; after ``model.float()`` it cannot tell, and restores the half dtype.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import gc
import logging
import threading
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

__all__ = ["Fp32Handle", "Fp32Group", "keep_fp32", "force_fp32", "resolve_modules"]

logger = logging.getLogger(__name__)

_LOW_PRECISION = {torch.float16, torch.bfloat16}
_compiler = getattr(torch, "compiler", None)
_is_compiling = getattr(_compiler, "is_compiling", None) or (lambda: False)


def _run_eagerly(owner: Any, name: str, fn: Callable) -> Callable:
    """``fn`` behind ``torch.compiler.disable``, made once per ``owner`` when dynamo first traces a hook
    (dynamo is imported by then): the hooks keep per-call state (autocast contexts on a stack) that a
    traced hook would guard on, so a compiled model recompiled at every step, then fell back to eager at
    dynamo's recompile limit (an audit: 9 recompiles in 30 steps). Run eagerly, a kept module is a graph
    break."""
    got = owner.__dict__.get(name)
    if got is None:
        got = owner.__dict__[name] = _compiler.disable(fn)
    return got


class _Upcast:
    """A parameter or buffer that kept modules made float32: its dtype before, and how many handles hold it
    so. Handles whose modules share it (nested kept modules, the same module kept twice, a tied weight) each
    count once; the last one removed puts it back."""

    __slots__ = ("ref", "dtype", "holders")

    def __init__(self, t: torch.Tensor, dtype: torch.dtype) -> None:
        self.ref = weakref.ref(t, lambda _, k=id(t): _UPCAST_FROM.pop(k, None))
        self.dtype = dtype
        self.holders = 0


_UPCAST_FROM: dict[int, _Upcast] = {}  # id(tensor) -> what made it float32 (see _Upcast)


def _upcast_entry(t: torch.Tensor) -> _Upcast | None:
    entry = _UPCAST_FROM.get(id(t))
    return entry if entry is not None and entry.ref() is t else None


for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _LOW_PRECISION.add(getattr(torch, _name))


def _autocast_device_types() -> tuple[str, ...]:
    names = ["cpu", "cuda", "xpu", "mps", "hpu", "mtia", "maia", "ipu", "xla"]
    try:
        names.append(torch._C._get_privateuse1_backend_name())
    except Exception:  # pragma: no cover - very old torch
        pass
    found = []
    for name in dict.fromkeys(names):
        try:
            if torch.amp.autocast_mode.is_autocast_available(name):
                torch.is_autocast_enabled(name)
                found.append(name)
        except Exception:  # noqa: BLE001 - a device type this build does not know
            continue
    return tuple(found)


_DEVICE_TYPES = _autocast_device_types()


def _enabled_autocast_devices() -> list[str]:
    return [d for d in _DEVICE_TYPES if torch.is_autocast_enabled(d)]


def _map_floats(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to floating tensors nested in tuples/lists/dicts/dataclasses; unchanged objects are
    returned as they are (identity kept)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        items = [_map_floats(v, fn) for v in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        if isinstance(obj, list):
            return items
        if hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*items)
        return type(obj)(items)
    if isinstance(obj, dict):
        new = {k: _map_floats(v, fn) for k, v in obj.items()}
        if all(new[k] is v for k, v in obj.items()):
            return obj
        if type(obj) is dict:
            return new
        out = copy.copy(obj)  # dict subclasses (OrderedDict, HF ModelOutput) keep their type
        for k, v in new.items():
            out[k] = v
        return out
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = [f.name for f in dataclasses.fields(obj)]
        values = {k: getattr(obj, k) for k in fields}
        new = {k: _map_floats(v, fn) for k, v in values.items()}
        if all(new[k] is v for k, v in values.items()):
            return obj
        out = copy.copy(obj)
        for k, v in new.items():
            object.__setattr__(out, k, v)  # frozen dataclasses too
        return out
    return obj


def _first_low_precision_dtype(obj: Any) -> torch.dtype | None:
    if isinstance(obj, torch.Tensor):
        return obj.dtype if obj.dtype in _LOW_PRECISION else None
    if isinstance(obj, (list, tuple)):
        values: Iterable[Any] = obj
    elif isinstance(obj, dict):
        values = obj.values()
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        values = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    else:
        return None
    for v in values:
        dt = _first_low_precision_dtype(v)
        if dt is not None:
            return dt
    return None


def _has_floating(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.is_floating_point()
    if isinstance(obj, (list, tuple)):
        return any(_has_floating(v) for v in obj)
    if isinstance(obj, dict):
        return any(_has_floating(v) for v in obj.values())
    return False


def _to_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in _LOW_PRECISION else t


class _Fp32Region:
    """Forced module calls in progress on each thread, and the wrapper of ``autocast.__enter__``
    that keeps autocast off inside them, installed while any :class:`Fp32Handle` is active."""

    local = threading.local()
    lock = threading.Lock()
    handles = 0
    original: Any = None

    @classmethod
    def depth(cls) -> int:
        return getattr(cls.local, "depth", 0)

    @classmethod
    def enter(cls) -> None:
        cls.local.depth = cls.depth() + 1

    @classmethod
    def exit(cls) -> None:
        cls.local.depth = max(0, cls.depth() - 1)

    @classmethod
    def add_handle(cls) -> None:
        with cls.lock:
            cls.handles += 1
            if cls.handles == 1:
                ac = torch.amp.autocast_mode.autocast
                cls.original = original = ac.__enter__

                def __enter__(self: Any) -> Any:
                    if self._enabled and cls.depth():  # entered inside a forced module: stays off
                        self._enabled = False
                        try:
                            return original(self)
                        finally:
                            self._enabled = True  # (a decorator's instance is entered again later)
                    return original(self)

                __enter__.__wrapped__ = original  # type: ignore[attr-defined]
                ac.__enter__ = __enter__

    @classmethod
    def drop_handle(cls) -> None:
        with cls.lock:
            cls.handles -= 1
            if cls.handles == 0 and cls.original is not None:
                torch.amp.autocast_mode.autocast.__enter__ = cls.original
                cls.original = None


class _Guard:
    """One handle's share of the autocast wrapper: given back by ``remove()``, or when the handle
    is garbage collected (a model copy that still forces a module holds a handle of its own)."""

    __slots__ = ("held", "__weakref__")

    def __init__(self, hold: bool = True) -> None:
        self.held = hold
        if hold:
            _Fp32Region.add_handle()

    def release(self) -> None:
        if self.held:
            self.held = False
            _Fp32Region.drop_handle()

    @classmethod
    def of(cls, handle: Any, hold: bool = True) -> _Guard:
        guard = cls(hold)
        weakref.finalize(handle, guard.release)
        return guard


class Fp32Handle:
    """Keeps one module in FP32 until :meth:`remove` (or the end of a ``with`` block)."""

    def __init__(self, module: nn.Module, *, tied: str = "copy") -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"keep_fp32 expects an nn.Module, got {type(module).__name__}; pass the layer "
                "itself, e.g. keep_fp32(model.blocks[3].attn)"
            )
        if tied not in ("copy", "upcast"):
            raise ValueError(f"tied={tied!r}; expected 'copy' or 'upcast'")
        self._module_ref = weakref.ref(module)
        self._name = type(module).__name__
        self._local = threading.local()
        # id(tensor) -> (tensor, original dtype); tensors kept alive so ids stay unique.
        self._upcast: dict[int, tuple[torch.Tensor, torch.dtype]] = {}
        # "copy": a half/bf16 tensor that a module outside this one also holds (a tied weight) keeps its dtype,
        # and each forward computes from an FP32 copy of it (id -> (tensor, dtype) here); "upcast": it is made
        # float32 like the others (force_fp32, which forces the partner module too)
        self._tied = tied
        self._copied: dict[int, tuple[torch.Tensor, torch.dtype]] = {}
        self._removed = False
        self._upcast_params(module)
        self._pre = module.register_forward_pre_hook(self._pre_hook, with_kwargs=True, prepend=True)
        try:
            self._post = module.register_forward_hook(
                self._post_hook, with_kwargs=True, always_call=True, prepend=True
            )
        except BaseException:
            self._pre.remove()
            self._restore_params()
            raise
        self._guard = _Guard.of(self)
        logger.debug("keep_fp32: %s forced to fp32", self._name)

    # -- public -------------------------------------------------------------------------
    @property
    def module(self) -> nn.Module | None:
        return self._module_ref() if self._module_ref is not None else None

    @property
    def active(self) -> bool:
        return not self._removed

    def remove(self) -> None:
        """Remove the hooks and restore parameter/buffer dtypes. Safe to call twice."""
        if self._removed:
            return
        self._removed = True
        try:
            self._pre.remove()
            self._post.remove()
            stack = self._stack()
            if stack:
                # Removed from inside the module's own forward: its exit hook will not run.
                logger.warning("keep_fp32 handle of %s removed during its forward; restoring autocast now",
                               self._name)
                while stack:
                    self._exit_frame(stack.pop())
                    _Fp32Region.exit()
        finally:
            self._guard.release()
            self._restore_params()
            self._copied.clear()

    def __enter__(self) -> Fp32Handle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self._removed else "active"
        return f"Fp32Handle({self._name}, {state})"

    # copy.deepcopy(model) / torch.save(model) copy the hooks, hence this handle: the copy
    # keeps running in FP32 but its handle no longer knows the (original) module.
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_local", None)
        state.pop("_guard", None)
        state.pop("_eager_pre", None)  # (bound to this handle: the copy makes its own)
        state.pop("_eager_post", None)
        state["_module_ref"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local = threading.local()
        self._guard = _Guard.of(self, not self._removed)  # the copy's hooks force its module too
        if not self._removed:  # the copy's tensors, held by the copy's handles (see _Upcast)
            for t, dtype in self._upcast.values():
                entry = _upcast_entry(t)
                if entry is None:
                    entry = _UPCAST_FROM[id(t)] = _Upcast(t, dtype)
                entry.holders += 1

    # -- internals ----------------------------------------------------------------------
    def _stack(self) -> list[tuple[list[torch.autocast], torch.dtype | None, list]]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _upcast_params(self, module: nn.Module) -> None:
        tensors = (*module.parameters(), *module.buffers())
        shared: set[int] = set()
        if self._tied == "copy":
            new = [t for t in tensors if t.dtype in _LOW_PRECISION and id(t) not in self._copied]
            if new:  # (a pure half model: once, or again after the model was cast since)
                shared = _held_outside(module, new)
        for t in tensors:
            if id(t) in shared or id(t) in self._copied:
                if t.dtype in _LOW_PRECISION:
                    self._copied[id(t)] = (t, t.dtype)
                continue
            key = id(t)
            entry = _upcast_entry(t)
            if t.dtype not in _LOW_PRECISION:
                if entry is not None and key not in self._upcast and t.dtype == torch.float32:
                    entry.holders += 1  # (shared with another kept module, which upcast it)
                    self._upcast[key] = (t, entry.dtype)
                continue
            if entry is None:
                entry = _UPCAST_FROM[key] = _Upcast(t, t.dtype)
            # the dtype to restore is the latest one seen: a model cast since (.bfloat16() after
            # keep_fp32 on a .half() model) goes back to what the user cast it to
            entry.dtype = t.dtype
            if key not in self._upcast:
                entry.holders += 1
            self._upcast[key] = (t, t.dtype)
            with torch.no_grad():
                t.data = t.data.float()
                grad = t.grad if isinstance(t, nn.Parameter) else None
                if grad is not None and grad.dtype != torch.float32:
                    t.grad = grad.float()

    def _restore_params(self) -> None:
        """Give back this handle's hold on the tensors it runs in FP32; those no other handle holds go back
        to their dtype before (same objects; values rounded back, exact for what FP32 did not change)."""
        with torch.no_grad():
            for key, (t, dtype) in self._upcast.items():
                entry = _upcast_entry(t)
                if entry is not None:
                    entry.holders -= 1
                    if entry.holders > 0:
                        continue  # another kept module still runs with it in FP32
                    _UPCAST_FROM.pop(key, None)
                    dtype = entry.dtype
                if t.dtype != torch.float32:
                    continue  # already back, or cast by the user since (model.double()): leave it
                t.data = t.data.to(dtype)
                grad = t.grad if isinstance(t, nn.Parameter) else None
                if grad is not None and grad.dtype != dtype:
                    t.grad = grad.to(dtype)
        self._upcast.clear()

    def _swap_in_copies(self, module: nn.Module) -> list[tuple[nn.Module, str, str, torch.Tensor]]:
        """Put an FP32 copy (``tensor.float()``: gradients flow back to the tensor, in its dtype) in place of
        each tied half/bf16 tensor of ``module`` and its submodules for one call; returns what to put back."""
        swaps: list[tuple[nn.Module, str, str, torch.Tensor]] = []
        if not self._copied:
            return swaps
        casts: dict[int, torch.Tensor] = {}
        for sub in module.modules():
            for where in ("_parameters", "_buffers"):
                table = getattr(sub, where)
                for name, t in table.items():
                    if t is None or id(t) not in self._copied or t.dtype not in _LOW_PRECISION:
                        continue
                    cast = casts.get(id(t))
                    if cast is None:
                        cast = casts[id(t)] = t.float()
                    swaps.append((sub, where, name, t))
                    table[name] = cast
        return swaps

    @staticmethod
    def _exit_frame(frame: tuple[list[torch.autocast], torch.dtype | None, list]) -> None:
        contexts, _, swaps = frame
        for sub, where, name, t in reversed(swaps):
            getattr(sub, where)[name] = t
        for ctx in reversed(contexts):
            ctx.__exit__(None, None, None)

    def _pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if _is_compiling():
            return _run_eagerly(self, "_eager_pre", self._pre_call)(module, args, kwargs)
        return self._pre_call(module, args, kwargs)

    def _post_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if _is_compiling():
            return _run_eagerly(self, "_eager_post", self._post_call)(module, args, kwargs, output)
        return self._post_call(module, args, kwargs, output)

    def _pre_call(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._upcast_params(module)  # cheap no-op unless someone called .half() since
        devices = _enabled_autocast_devices()
        cast_back = None if devices else _first_low_precision_dtype((args, kwargs))
        if cast_back is None and not devices and not _has_floating((args, kwargs)):
            # No floating input to take the dtype from (an Embedding's indices): the rest of a
            # pure half model expects what the module produced before, its parameters' dtype.
            cast_back = next((_dtype_before(t, dt) for t, dt in (*self._upcast.values(), *self._copied.values())),
                             None)
        contexts: list[torch.autocast] = []
        swaps: list = []
        try:
            for dev in devices:
                ctx = torch.autocast(dev, enabled=False)
                ctx.__enter__()
                contexts.append(ctx)
            new_args = _map_floats(args, _to_fp32)
            new_kwargs = _map_floats(kwargs, _to_fp32)
            swaps = self._swap_in_copies(module)
        except BaseException:
            self._exit_frame((contexts, None, swaps))
            raise
        self._stack().append((contexts, cast_back, swaps))
        _Fp32Region.enter()
        return new_args, new_kwargs

    def _post_call(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        stack = self._stack()
        if not stack:  # our pre-hook did not run for this call (an earlier global pre-hook raised)
            return None
        frame = stack.pop()
        _Fp32Region.exit()
        self._exit_frame(frame)
        cast_back = frame[1]
        if cast_back is None or output is None:
            return None
        return _map_floats(output, lambda t: t.to(cast_back) if t.dtype == torch.float32 else t)


class Fp32Group:
    """Several :class:`Fp32Handle` removed together (what :func:`force_fp32` returns)."""

    def __init__(self, handles: list[Fp32Handle], names: list[str]) -> None:
        self.handles = handles
        self.names = names

    def remove(self) -> None:
        """Remove every handle, last forced first. Safe to call twice."""
        errors: list[BaseException] = []
        for h in reversed(self.handles):
            try:
                h.remove()
            except Exception as e:  # noqa: BLE001 - keep restoring the others
                errors.append(e)
        if errors:
            raise RuntimeError(f"force_fp32: {len(errors)} module(s) failed to restore") from errors[0]

    @property
    def active(self) -> bool:
        return any(h.active for h in self.handles)

    def enter_call_late(self, module: nn.Module, args: tuple) -> tuple | None:
        """For a call already past its own pre-hooks (the root, found by a global pre-hook at its
        first call): run the forcing pre-hook by hand and return the cast args; the post-hook,
        registered by then, closes it. ``None`` when ``module`` is not forced here."""
        for h in self.handles:
            if h.module is module and h.active:
                new_args, _ = h._pre_hook(module, args, {})
                return new_args
        return None

    def __enter__(self) -> Fp32Group:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"Fp32Group({self.names})"


def keep_fp32(module: nn.Module) -> Fp32Handle:
    """Run ``module``'s forward in FP32 from now on: autocast disabled inside it, its
    low-precision floating inputs cast to float32; in a pure half/bf16 model its
    parameters and buffers become float32 (those tied to a module outside it keep their dtype,
    and each call computes from an FP32 copy) and its outputs are cast back to the input dtype.

    Returns a handle; ``handle.remove()`` (or leaving ``with keep_fp32(m):``) restores the
    module exactly. Does not sync with the GPU.
    """
    return Fp32Handle(module)


@contextlib.contextmanager
def autocast_off() -> Iterator[list[int]]:
    """Every ``torch.autocast`` region entered while this is on (``with torch.autocast(...)``, the
    decorator, ``torch.cuda.amp.autocast``) is entered disabled: the script's own code outside its
    modules (a loss computed under autocast) runs in FP32 too. Bisect's control for a run whose layers
    all in FP32 still break. Yields ``[n]``: how many enabled regions it turned off (0: the script has none)."""
    turned = [0]
    ac = torch.amp.autocast_mode.autocast
    original = ac.__enter__

    def __enter__(self: Any) -> Any:
        if getattr(self, "_enabled", False):
            turned[0] += 1
        self._enabled = False
        return original(self)

    ac.__enter__ = __enter__
    try:
        yield turned
    finally:
        if ac.__enter__ is __enter__:
            ac.__enter__ = original


def resolve_modules(model: nn.Module, names: Iterable[str], *, what: str = "force_fp32") -> list[tuple[str, nn.Module]]:
    """``(name, module)`` for qualified names from ``model.named_modules()``, in the order given
    (duplicates dropped). Unknown names raise ``ValueError`` listing close matches."""
    table = dict(model.named_modules(remove_duplicate=False))
    out = []
    for name in dict.fromkeys(names):
        if name not in table:
            close = difflib.get_close_matches(name, list(table), n=5, cutoff=0.6)
            hint = f"close matches: {close}" if close else f"some valid names: {list(table)[:8]}"
            raise ValueError(
                f"{what}: {type(model).__name__} has no module named {name!r}; {hint}. "
                "Use qualified names from model.named_modules()."
            )
        out.append((name, table[name]))
    return out


def _held_outside(module: nn.Module, tensors: list[torch.Tensor]) -> set[int]:
    """ids of the ``tensors`` (parameters/buffers of ``module``) that a module outside ``module`` also holds:
    a weight tied to another module's (GPT-2's ``lm_head.weight`` is ``wte.weight``). ``keep_fp32`` is given
    the module alone, not the model, so the owners are found as the referrers of the tensors: the
    ``_parameters``/``_buffers`` tables that hold them, and the modules' ``__dict__`` that hold those (two
    ``gc.get_referrers`` scans, done once per half/bf16 tensor, never under autocast with FP32 parameters)."""
    inside = {id(getattr(sub, where)) for sub in module.modules() for where in ("_parameters", "_buffers")}
    want = {id(t) for t in tensors}
    tables = [r for r in gc.get_referrers(*tensors)
              if isinstance(r, dict) and id(r) not in inside and any(id(v) in want for v in r.values())]
    if not tables:
        return set()
    ids = {id(t) for t in tables}
    owned = set()
    for r in gc.get_referrers(*tables):
        if isinstance(r, nn.Module):
            found = [getattr(r, w, None) for w in ("_parameters", "_buffers")]
        elif isinstance(r, dict):
            found = [r.get(w) for w in ("_parameters", "_buffers")]
        else:
            continue
        owned.update(id(f) for f in found if f is not None and id(f) in ids)
    return {id(v) for t in tables if id(t) in owned for v in t.values() if id(v) in want}


def _dtype_before(t: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """The dtype ``t`` had before kept modules made it float32 (``dtype`` where none did)."""
    entry = _upcast_entry(t)
    return dtype if entry is None else entry.dtype


def _tied_partners(model: nn.Module, resolved: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Modules outside ``resolved`` that own a half/bf16 parameter of a module in it (tied weights: a
    GPT-2's ``wte`` and ``lm_head``). Forcing one of them to FP32 makes the shared parameter float32
    for both, and the other one's forward then fails on the dtype mismatch, so they are forced too."""
    inside: set[int] = set()
    shared: set[int] = set()
    for _, m in resolved:
        for sub in m.modules():
            inside.add(id(sub))
        # (a half parameter, or one another forced module made FP32: force_fp32(["lm_head"]) while wte is forced)
        shared.update(id(p) for p in m.parameters() if p.dtype in _LOW_PRECISION or _upcast_entry(p) is not None)
    if not shared:
        return []
    out = []
    for name, m in model.named_modules():
        if id(m) in inside:
            continue
        if any(id(p) in shared for p in m.parameters(recurse=False)):
            out.append((name, m))
            inside.update(id(sub) for sub in m.modules())
    return out


def force_fp32(model: nn.Module, names: Iterable[str]) -> Fp32Group:
    """Force the modules of ``model`` named ``names`` (qualified names from
    ``model.named_modules()``) to FP32, as a bisect trial does. Unknown names raise
    ``ValueError`` before anything is changed."""
    resolved = resolve_modules(model, names)
    resolved += _tied_partners(model, resolved)
    handles: list[Fp32Handle] = []
    seen: set[int] = set()
    try:
        for _, module in resolved:
            if id(module) in seen:  # the same module reachable under two names
                continue
            seen.add(id(module))
            handles.append(Fp32Handle(module, tied="upcast"))  # (the partners are forced too: see _tied_partners)
    except BaseException:
        for h in reversed(handles):
            h.remove()
        raise
    names = [n for n, _ in resolved]
    logger.debug("force_fp32: %d module(s) forced: %s", len(handles), names)
    return Fp32Group(handles, names)
