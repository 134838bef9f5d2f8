"""Op drill-down: which op inside a culprit module overflows first, and on which source line.

:class:`OpProbe` enables a :class:`torch.overrides.TorchFunctionMode` only while the named
modules' forward runs (entered in a forward pre-hook, left in a forward hook registered
with ``always_call=True``, with a depth count so nested or re-entered probed modules share
one mode). For every torch function called there whose output is floating point it checks
the output against the target format:

* **producer**: the output has NaN/Inf although every floating input was finite (e.g. an
  fp16 ``matmul`` under autocast whose result exceeds 65504); an additive attention mask of 0
  and -Inf counts as finite when the output holds a NaN or a +Inf, which the mask cannot make;
* **overflow**: finite values with ``|x| > fmt.max`` (fp32 outputs that would become Inf
  when cast to the format).

An additive mask's own huge values are never the overflow: HF transformers' ``finfo(float32).min``
at masked positions (beyond fp16's max), carried on by ``scores + mask`` and the ops after it, does
not count, nor does the -Inf where fp16's ``-65504`` plus a negative score rounds beyond the range;
the op that made values too large from values in range (the ``q @ k`` before the add) is named.

Ops are named the way the user wrote them: ``matmul`` for ``q @ k`` (``Tensor.__matmul__``),
``mul`` for ``x * x``, ``linear`` (``F.linear`` inside ``nn.Linear``), ``softmax``, ``pow``;
reflected operators lose their ``r`` and in-place ones get a trailing ``_`` (``__imul__`` ->
``mul_``). The source location is the innermost stack frame outside torch and ampdoctor
(a Jupyter cell's as IPython names it: ``cell In[5], line 7``); ops called from ampdoctor's
own code (other hooks inside the module) are not recorded.

Backward: every recorded op output that requires grad gets a tensor hook, so the
*gradient* flowing into that op's output is checked too (``phase="backward"``, same op name
and line). That names the op whose output gradient first went non-finite or overflowed,
not the aten backward kernel that produced it. A ``torch.autograd.Function`` made inside a probed
module runs user code in its ``backward``: the mode is on while it runs, so its ops are recorded
(``phase="backward"``) at their lines inside it.

This is a diagnostic run: it syncs with the device for every op inside the probed modules.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import sysconfig
import threading
import weakref
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..formats import Format, get_format
from ..precision import resolve_modules
from ..stats import decode_row, tensor_stats

__all__ = ["OpFinding", "OpProbe", "drill_down"]

logger = logging.getLogger(__name__)

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_STDLIB_DIR = sysconfig.get_paths()["stdlib"] + os.sep
_BINARY = {"add", "sub", "mul", "matmul", "truediv", "floordiv", "div", "pow", "mod",
           "and", "or", "xor", "lshift", "rshift"}
# Recomputing these in fp32 to measure the true magnitude would change state (RNG, inputs).
_GRAPH_NODES = 2000  # autograd nodes walked per probed call, looking for custom Functions
_NO_RECOMPUTE = ("dropout", "rand", "normal", "bernoulli", "multinomial")


@dataclass
class OpFinding:
    layer: str  # qualified name of the innermost probed module running the op
    op: str  # "matmul", "mul", "linear", ...
    where: str  # "model.py:42" ("cell In[5], line 7" in a notebook)
    absmax: float  # abs-max of the finite values of the output (or of its gradient)
    # forward: the output has NaN/Inf although the inputs were finite (a producer);
    # backward: the gradient w.r.t. the output has NaN/Inf
    nonfinite: bool
    overflow_count: int  # values beyond the format's max (Inf produced here counts too)
    step: Optional[int] = None
    phase: str = "forward"  # "backward": the gradient w.r.t. this op's output
    path: str = ""  # full path of ``where``'s file
    dtype: str = ""  # dtype of the output
    absmax_fp32: Optional[float] = None  # producers: the same op recomputed in fp32
    # an overflow whose floating inputs already held values beyond the format's max (or NaN/Inf):
    # the op passed them on (a transpose, a reshape, a dropout of an input that was too large); in
    # backward, a non-finite gradient of an op whose output is the probed module's: it came in so
    # from outside the module
    passthrough: bool = False

    @property
    def magnitude(self) -> float:
        """How large the values really got: the fp32 recomputation when there is one, Inf for
        a non-finite output without one, else the finite abs-max."""
        if self.absmax_fp32 is not None:
            return self.absmax_fp32
        return float("inf") if self.nonfinite else self.absmax

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _op_name(func: Callable) -> str:
    name = getattr(func, "__name__", None) or str(func)
    if name.startswith("__") and name.endswith("__") and len(name) > 4:
        core = name[2:-2]
        if core in _BINARY:
            return core
        if core[:1] == "r" and core[1:] in _BINARY:
            return core[1:]
        if core[:1] == "i" and core[1:] in _BINARY:
            return core[1:] + "_"
        return core
    return name


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    return []


def _nonfinite_scalar(obj: Any) -> bool:
    """A Python number that is itself Inf/NaN (``masked_fill(mask, float("-inf"))``): the op was
    asked for that value, it did not overflow."""
    if isinstance(obj, float):
        return not math.isfinite(obj)
    if isinstance(obj, (list, tuple)):
        return any(_nonfinite_scalar(v) for v in obj)
    if isinstance(obj, dict):
        return any(_nonfinite_scalar(v) for v in obj.values())
    return False


def _additive_mask(x: torch.Tensor) -> bool:
    """An additive attention mask: every value 0, -Inf (``nn.Transformer.generate_square_subsequent_mask``,
    ``attn_mask`` of ``nn.MultiheadAttention``) or its dtype's most negative finite value (HF transformers'
    ``torch.finfo(dtype).min``). Its -Inf (or -65504) was asked for; it does not make the op's input
    non-finite, or too large, in the sense of an overflow that came in."""
    if not x.is_floating_point():
        return False
    return bool(((x == 0) | (x == float("-inf")) | (x == torch.finfo(x.dtype).min)).all())


def _beyond(x: torch.Tensor, fmax: float) -> Optional[float]:
    """The abs-max of floating tensor ``x`` (Inf: it holds a NaN/Inf) where it is beyond ``fmax``;
    None where it is within it, or ``x`` is empty or an additive mask (two reductions, no copy)."""
    if not x.is_floating_point() or not x.numel() or _additive_mask(x):
        return None
    x = x.detach()
    m = math.inf if not bool(torch.isfinite(x).all()) else max(float(x.max()), -float(x.min()))
    return m if m > fmax else None


def _made_overflow(t: torch.Tensor, fmax: float, mag: float) -> int:
    """How many finite values of ``t`` are beyond ``fmax`` but not of an additive mask's magnitude ``mag``
    (at least half of it: a score added to finfo.min is still about finfo.min)."""
    a = t.detach().float().abs()
    return int(((a > fmax) & (a < mag / 2)).sum())


def _mask_made_inf(t: torch.Tensor, masks: list[tuple[torch.Tensor, float]]) -> bool:
    """Whether every -Inf of ``t`` sits where one of the mask-carrying inputs ``masks`` holds its mask's
    magnitude: fp16's -65504 plus a negative score, or fp32's finfo.min cast to fp16, is -Inf because the
    mask asked for a huge negative value there, not because this op overflowed."""
    neg = torch.isneginf(t.detach())
    for x, mag in masks:
        try:
            masked = torch.broadcast_to(x.detach() <= -mag / 2, t.shape)
        except RuntimeError:  # not of the output's shape: an input of a fused op (attention with attn_mask)
            continue
        if not bool((neg & ~masked).any()):
            return True
    return False


def _user_frame() -> Optional[tuple[str, int]]:
    """(file, line) of the innermost frame outside torch (and this file); None when that
    frame is ampdoctor's own code (e.g. another hook running inside the probed module)."""
    f = sys._getframe(1)
    while f is not None and f.f_code.co_filename == __file__:
        f = f.f_back
    while f is not None:
        fn = f.f_code.co_filename
        stdlib = fn.startswith(_STDLIB_DIR) and "site-packages" not in fn and "dist-packages" not in fn
        if not (fn.startswith(_TORCH_DIR) or stdlib or fn.startswith("<frozen")):
            if fn.startswith(_PKG_DIR):
                return None
            return fn, f.f_lineno
        f = f.f_back
    return None


def _where(path: str, line: int) -> str:
    """``model.py:42``; a Jupyter/IPython cell's code, whose file is a temporary name
    (``/tmp/ipykernel_1234/3456.py``), as IPython's tracebacks name it: ``cell In[5], line 7``.
    IPython is not imported here: cells exist only in a process that has already imported it."""
    ipython = sys.modules.get("IPython")
    try:
        shell = ipython.get_ipython() if ipython is not None else None
        cell = shell.compile.format_code_name(path) if shell is not None else None  # IPython >= 8
    except Exception:  # noqa: BLE001 - an older or unusual shell: the file name it is
        cell = None
    if cell:
        label, name = cell
        return f"{label.lower()} {name}, line {line}"
    return f"{os.path.basename(path)}:{line}"


class _Mode(TorchFunctionMode):
    def __init__(self, probe: OpProbe) -> None:
        super().__init__()
        self.probe = probe

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if getattr(self.probe._local, "checking", False):
            return out  # the probe's own look at a module's inputs
        if name not in ("__get__", "__set__"):  # attribute access computes nothing
            try:
                self.probe._record(func, args, kwargs, out)
            except Exception:  # noqa: BLE001 - never break the user's forward
                logger.debug("OpProbe could not inspect %s", name, exc_info=True)
        return out


class OpProbe:
    """Records the ops that overflow inside ``module_names`` while active (a context manager).

    ``findings`` lists them in the order they happened; ``first`` is the answer (the first
    forward producer/overflow, else the first backward one); ``worst`` is the op with the
    largest :attr:`OpFinding.magnitude` seen in forward, overflowing or not (``worst_backward``
    the same for gradients). Set ``probe.step`` to stamp findings. ``backward=False`` skips
    the gradient checks. The probed-module stack and the mode are per thread (modes are).
    """

    def __init__(self, model: nn.Module, module_names: Sequence[str], fmt: str | Format = "fp16",
                 max_ops: int = 1000, backward: bool = True) -> None:
        if isinstance(module_names, str):
            module_names = [module_names]
        if not module_names:
            raise ValueError("OpProbe needs at least one module name to probe (from model.named_modules())")
        self.modules = resolve_modules(model, module_names, what="OpProbe")
        self.fmt = get_format(fmt)
        self.max_ops = int(max_ops)
        self.backward = backward
        self.step: Optional[int] = None
        self.findings: list[OpFinding] = []
        self.worst: Optional[OpFinding] = None
        self.worst_backward: Optional[OpFinding] = None
        self.ops_seen = 0
        # probed module -> (abs-max, step) of its floating inputs, where one already held a value beyond
        # the format's max, or a NaN/Inf, when the module was called (the values grew before it)
        self.inputs_beyond: dict[str, tuple[float, Optional[int]]] = {}
        self.inputs_first: dict[str, Optional[int]] = {}  # probed module -> the first step its input was so
        self._handles: list[Any] = []
        self._cells: dict[int, list] = {}  # id of an op output -> its grad hook's "is a module output" cell
        self._bwd_nodes: weakref.WeakSet = weakref.WeakSet()  # the custom Function nodes whose backward is probed
        # id of an op output that holds an additive mask's magnitude -> (weak reference, that magnitude)
        self._masked: dict[int, tuple[Any, float]] = {}
        self._local = threading.local()  # .stack: probed modules running, .mode: the active mode
        self._lock = threading.Lock()
        self._closed = True

    @property
    def first(self) -> Optional[OpFinding]:
        """The first forward op that made the trouble: a producer, or an overflow from inputs
        within range; an op that only passed on values already too large comes after them."""
        fwd = [f for f in self.findings if f.phase == "forward"]
        made = [f for f in fwd if not f.passthrough]
        made_bwd = [f for f in self.findings if f.phase == "backward" and not f.passthrough]
        return (made or fwd or made_bwd or self.findings or [None])[0]

    @property
    def _stack(self) -> list[str]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def __enter__(self) -> OpProbe:
        if not self._closed:
            raise RuntimeError("this OpProbe is already active; create a new one per run")
        self._closed = False
        try:
            for name, module in self.modules:
                self._handles.append(module.register_forward_pre_hook(self._pre_hook(name)))
                self._handles.append(module.register_forward_hook(self._post_hook(), always_call=True,
                                                                  prepend=True))
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        """Remove the hooks (and the mode, if left inside a forward). Safe to call twice."""
        self._closed = True
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._unwind_bwd(stale_only=False)
        if getattr(self._local, "mode", None) is not None:
            self._stack.clear()
            self._exit_mode()

    # -- hooks ------------------------------------------------------------------------------
    # Plain closures, not bound methods: copy.deepcopy(model) while probing shares them
    # instead of copying the probe, and they do nothing once the probe is closed.
    def _pre_hook(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            if self._closed:
                return
            self._unwind_bwd(stale_only=True)
            stack = self._stack
            if not stack:
                mode = _Mode(self)
                mode.__enter__()
                self._local.mode = mode
            stack.append(name)
            self._local.checking = True  # (the mode is on: these ops are ours, not the module's)
            try:
                self._check_inputs(name, args)
            except Exception:  # noqa: BLE001 - never break the user's forward
                logger.debug("OpProbe could not check the inputs of %s", name, exc_info=True)
            finally:
                self._local.checking = False
        return hook

    def _check_inputs(self, name: str, args: tuple) -> None:
        """Remember when a floating input of ``name`` already held a value beyond the format's max
        (or a NaN/Inf) as the module was called: the largest abs-max seen so (Inf: a NaN/Inf)."""
        seen = self.inputs_beyond.get(name)
        if seen is not None and math.isinf(seen[0]):
            return
        worst = max((m for x in _tensors(args) if (m := _beyond(x, self.fmt.max)) is not None), default=None)
        if worst is not None:
            self.inputs_first.setdefault(name, self.step)
            if seen is None or worst > seen[0]:
                self.inputs_beyond[name] = (worst, self.step)

    def _post_hook(self) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            stack = self._stack
            if not stack:
                return
            if self.backward and not getattr(self._local, "bwd", None):
                try:
                    self._hook_custom_backwards(stack[-1], args, output)
                except Exception:  # noqa: BLE001 - never break the user's forward
                    logger.debug("OpProbe could not look for custom backwards in %s", stack[-1], exc_info=True)
            for t in _tensors(output):  # its ops' outputs that leave the module: their gradients come from outside
                cell = self._cells.get(id(t))
                if cell is not None:
                    cell[0] = True
            stack.pop()
            if not stack:
                self._cells.clear()
                self._masked.clear()
                self._exit_mode()
        return hook

    def _hook_custom_backwards(self, layer: str, args: tuple, output: Any) -> None:
        """The ``torch.autograd.Function`` nodes the module's forward made (its autograd graph from the outputs
        back to the inputs', at most ``_GRAPH_NODES`` nodes): their ``backward`` is user code no op hook sees,
        so the mode is on while it runs (a pre-hook and a hook on the node) and its ops are recorded as
        ``phase="backward"``, with their source lines inside it (``3 * x * x`` that overflows fp16)."""
        stop = {id(x.grad_fn) for x in _tensors(args) if x.grad_fn is not None}
        todo = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
        seen: set[int] = set()
        while todo and len(seen) < _GRAPH_NODES:
            node = todo.pop()
            if node is None or id(node) in seen or id(node) in stop:
                continue
            seen.add(id(node))
            if hasattr(node, "_forward_cls") and node not in self._bwd_nodes:
                self._bwd_nodes.add(node)
                self._handles.append(node.register_prehook(self._bwd_enter(layer)))
                self._handles.append(node.register_hook(self._bwd_leave()))
            todo.extend(n for n, _ in node.next_functions)

    def _bwd_enter(self, layer: str) -> Callable:
        def prehook(grad_outputs: tuple) -> None:
            if self._closed:
                return
            loc = self._local
            # (this thread's forward state is kept aside: autograd may run it inside a probed forward)
            loc.bwd = (getattr(loc, "stack", None), getattr(loc, "mode", None), getattr(loc, "bwd", None))
            loc.stack = [layer]
            if loc.bwd[1] is None:
                loc.mode = _Mode(self)
                loc.mode.__enter__()
        return prehook

    def _bwd_leave(self) -> Callable:
        def hook(grad_inputs: tuple, grad_outputs: tuple) -> None:
            loc = self._local
            saved = getattr(loc, "bwd", None)
            if not saved:
                return
            if saved[1] is None:
                self._exit_mode()
            loc.stack, loc.mode, loc.bwd = saved
        return hook

    def _unwind_bwd(self, stale_only: bool) -> None:
        """Put back this thread's forward state that a custom backward's pre-hook kept aside: where its hook
        never ran (the backward raised, and autograd put back the thread's mode stack, so no mode is on), or
        all of it (``stale_only`` False: the probe is being removed)."""
        loc = self._local
        while getattr(loc, "bwd", None):
            on = torch._C._is_torch_function_mode_enabled()
            if stale_only and on:
                return  # (a custom backward is running)
            saved = loc.bwd
            if saved[1] is None and on:
                self._exit_mode()
            loc.stack, loc.mode, loc.bwd = saved

    def _exit_mode(self) -> None:
        mode, self._local.mode = getattr(self._local, "mode", None), None
        if mode is not None:
            mode.__exit__(None, None, None)

    # -- recording --------------------------------------------------------------------------
    def _record(self, func: Callable, args: tuple, kwargs: dict, out: Any) -> None:
        outs = [t for t in _tensors(out) if t.is_floating_point()]
        if not outs:
            return
        loc = _user_frame()
        if loc is None:
            return
        op = _op_name(func)
        layer = self._stack[-1] if self._stack else "?"
        self.ops_seen += 1
        masks = self._mask_inputs(args, kwargs)
        mask = max((m for _, m in masks), default=None)
        for t in outs:
            d = decode_row(tensor_stats(t, self.fmt).tolist(), self.fmt)
            bad = d["nan"] + d["posinf"] + d["neginf"]
            producer = bad > 0 and not _nonfinite_scalar((args, kwargs)) and self._from_finite(args, kwargs, d) \
                and not (d["nan"] + d["posinf"] == 0 and _mask_made_inf(t, masks))
            # an op that builds an additive mask, adds one, or passes a masked tensor on (a cast, a view) has the
            # mask's magnitude by construction: not the worst op (HF's eager attention: its finfo.min mask and
            # what held it were always the largest); one whose output is small again (the softmax) ends that
            held = _additive_mask(t) if t.numel() else False
            mag = abs(torch.finfo(t.dtype).min) if held else mask
            held = held or (mag is not None and not d["absmax"] < mag / 2)
            if mag is not None and d["overflow"] > 0:
                # the values beyond the format's max that the mask carried in (HF's finfo(float32).min where a
                # position is masked) were not made here: count only those this op made from in-range values
                d["overflow"] = _made_overflow(t, self.fmt.max, mag)
            phase = "backward" if getattr(self._local, "bwd", None) else "forward"  # (inside a custom backward)
            finding = self._finding(layer, op, loc, d, producer, str(t.dtype).replace("torch.", ""), phase)
            if producer and t.dtype != torch.float32 and not any(k in op for k in _NO_RECOMPUTE) \
                    and not op.endswith("_") and "out" not in kwargs:
                finding.absmax_fp32 = self._absmax_fp32(func, args, kwargs)
            if not producer and d["overflow"] > 0:
                finding.passthrough = any(_beyond(x, self.fmt.max) is not None for x in _tensors((args, kwargs)))
            if held:
                self._masked[id(t)] = (weakref.ref(t), mag)
            self._keep(finding, producer or d["overflow"] > 0, worst=not held)
            if self.backward and t.requires_grad and phase == "forward":
                cell = self._cells[id(t)] = [False]  # set when t turns out to be the probed module's output
                t.register_hook(self._grad_hook(layer, op, loc, cell))

    def _mask_inputs(self, args: tuple, kwargs: dict) -> list[tuple[torch.Tensor, float]]:
        """The inputs that are an additive mask, or a tensor that carries one (see :meth:`_record`), each with
        the magnitude it holds so."""
        found = []
        for x in _tensors((args, kwargs)):
            got = self._masked.get(id(x))
            m = got[1] if got is not None and got[0]() is x else (
                abs(torch.finfo(x.dtype).min) if x.is_floating_point() and x.numel() and _additive_mask(x) else None)
            if m is not None:
                found.append((x, m))
        return found

    def _finding(self, layer: str, op: str, loc: tuple[str, int], d: dict, producer: bool,
                 dtype: str, phase: str) -> OpFinding:
        overflow = d["overflow"] + (d["posinf"] + d["neginf"] if producer else 0)
        return OpFinding(layer, op, _where(*loc), d["absmax"], producer,
                         int(overflow), self.step, phase, loc[0], dtype)

    def _keep(self, finding: OpFinding, notable: bool, worst: bool = True) -> None:
        with self._lock:
            attr = "worst" if finding.phase == "forward" else "worst_backward"
            current = getattr(self, attr)
            if worst and (current is None or finding.magnitude > current.magnitude):
                setattr(self, attr, finding)
            if notable and len(self.findings) < self.max_ops:
                self.findings.append(finding)
                logger.info("OpProbe: %s %s at %s in %s (absmax %.3g, nonfinite=%s)", finding.phase,
                            finding.op, finding.where, finding.layer, finding.absmax, finding.nonfinite)

    @staticmethod
    def _from_finite(args: tuple, kwargs: dict, d: dict) -> bool:
        """Whether an output's NaN/Inf (row ``d``) came from finite inputs: every floating input is
        finite, or the only non-finite ones are additive masks (0 and -Inf) and the output holds a
        NaN or a +Inf, which adding such a mask does not make."""
        nonfinite = [x for x in _tensors((args, kwargs)) if x.is_floating_point() and not bool(torch.isfinite(x).all())]
        if not nonfinite:
            return True
        return d["nan"] + d["posinf"] > 0 and all(_additive_mask(x) for x in nonfinite)

    @staticmethod
    def _absmax_fp32(func: Callable, args: tuple, kwargs: dict) -> Optional[float]:
        def up(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return x.detach().float() if x.is_floating_point() else x
            if isinstance(x, (list, tuple)):
                return type(x)(up(v) for v in x) if not hasattr(x, "_fields") else type(x)(*map(up, x))
            if isinstance(x, dict):
                return {k: up(v) for k, v in x.items()}
            return x
        devices = {t.device.type for t in _tensors((args, kwargs))} or {"cpu"}
        try:
            with torch.no_grad():
                ctxs = [torch.autocast(dev, enabled=False) for dev in devices]
                for c in ctxs:
                    c.__enter__()
                try:
                    res = func(*up(args), **up(kwargs))
                finally:
                    for c in reversed(ctxs):
                        c.__exit__(None, None, None)
            vals = [t for t in _tensors(res) if t.is_floating_point()]
            finite = [t[torch.isfinite(t)].abs() for t in vals]
            return max((float(t.max()) for t in finite if t.numel()), default=None)
        except Exception:  # noqa: BLE001 - a best-effort measurement
            return None

    def _grad_hook(self, layer: str, op: str, loc: tuple[str, int], cell: list) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            if self._closed or not grad.is_floating_point():
                return
            d = decode_row(tensor_stats(grad, self.fmt).tolist(), self.fmt)
            nonfinite = d["nan"] + d["posinf"] + d["neginf"] > 0
            finding = self._finding(layer, op, loc, d, nonfinite, str(grad.dtype).replace("torch.", ""),
                                    "backward")
            finding.passthrough = nonfinite and cell[0]
            self._keep(finding, nonfinite or d["overflow"] > 0)
        return hook


def drill_down(model: nn.Module, module_names: Sequence[str], run_fn: Callable[[], Any],
               fmt: str | Format = "fp16", max_ops: int = 1000) -> list[OpFinding]:
    """Run ``run_fn()`` (e.g. a few training steps) with an :class:`OpProbe` on
    ``module_names``; returns the findings in order (the first is the answer). Exceptions
    from ``run_fn`` propagate; use :class:`OpProbe` directly to keep findings then."""
    with OpProbe(model, module_names, fmt, max_ops=max_ops) as probe:
        run_fn()
    return probe.findings
