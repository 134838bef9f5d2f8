"""Module names as users write them: ``blocks.1.attn`` -> ``model.blocks[1].attn``."""

from __future__ import annotations

import keyword
import re
from typing import Container, Mapping, Optional

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


_INDEXABLE = ("Sequential", "ModuleList")


def module_expr(name: str, root: str = "model", types: Optional[Mapping[str, str]] = None) -> str:
    """Python expression for a qualified module name (``get_submodule`` when a part is no identifier).

    ``types`` (qualified name -> class name, e.g. the trace's layers) says what a numeric part indexes:
    ``[1]`` in a Sequential/ModuleList, ``["1"]`` in a ModuleDict (``[1]`` is a KeyError there), and
    ``get_submodule`` under any other parent (``add_module("1", ...)``); without it, ``[1]``."""
    owner, name = split_owner(name, types)
    if owner is not None:  # a second model watched automatically: ``D:net.2`` -> ``d.net[2]`` (your D object)
        root = owner.split("#")[0].lower() or root
    if not name or name == "(root)":
        return root
    parts = name.split(".")
    if not all(p.isdigit() or (_IDENT.match(p) and not keyword.iskeyword(p)) for p in parts):
        return f"{root}.get_submodule({name!r})"
    out, prefix = root, ""
    for p in parts:
        if p.isdigit():
            parent = (types or {}).get(prefix)
            if parent == "ModuleDict":
                out += f"[{p!r}]"
            elif parent is None or parent in _INDEXABLE:
                out += f"[{p}]"
            else:
                return f"{root}.get_submodule({name!r})"
        else:
            out += f".{p}"
        prefix = f"{prefix}.{p}" if prefix else p
    return out


def split_owner(name: str, types: Optional[Container[str]] = None) -> tuple[str | None, str]:
    """``("D", "net.2")`` for a second model's layer ``D:net.2`` (the watch names another model's
    layers ``Class:name``), ``(None, name)`` for the first model's, whose own names may hold a ``:``
    (a ModuleDict key ``"task:a"``). With ``types`` (the trace's layers), a name the trace holds is the
    first model's unless that other model's root layer (``D:``) is there too."""
    owner, sep, rest = name.partition(":")
    if not sep or "." in owner or not owner:
        return None, name
    if types is not None and name in types and f"{owner}:" not in types:
        return None, name
    return owner, rest


WRAPPED_NOTE = "-wrapped model: watching .module"  # after the wrapper class: the note ``watch.unwrap_model`` leaves


def wrapper_of(notes) -> str | None:
    """The DDP/FSDP/DataParallel wrapper the watched model was found in (from the trace's notes),
    or None: fix snippets name modules of the model inside it."""
    for n in notes:
        if WRAPPED_NOTE in n:
            return n.split(WRAPPED_NOTE)[0].strip().rsplit(" ", 1)[-1]
    return None


def wrapped_hint(wrapper: str | None) -> str:
    """What to add to a ``keep_fp32(model...)`` snippet when the model ran inside ``wrapper``."""
    if not wrapper:
        return ""
    return (f" (`model` is the module inside {wrapper}: call it before wrapping the model, or write "
            "`wrapped.module` for `model` under autocast; a pure .half()/.bfloat16() model must be fixed "
            "before wrapping, since keep_fp32 changes parameter dtypes the wrapper has already bucketed)")


def half_weights_under(name: str, half_weights: Mapping[str, str]) -> str | None:
    """The half dtype of the weights stored under module ``name`` (a pure ``.half()``/``.bfloat16()``
    model: ``half_weights`` maps layer names to the dtype of their float16/bfloat16 weights), or None."""
    return next((dt for n, dt in half_weights.items()
                 if name in ("", "(root)") or n == name or n.startswith(name + ".")), None)


def model_half(weight_dtypes) -> str | None:
    """The dtype of a pure ``.half()``/``.bfloat16()`` model (no autocast): where every weight recorded
    (``weight_dtypes``, one per weight) is that one float16/bfloat16 dtype; else None."""
    dts = set(weight_dtypes)
    return next(iter(dts)) if len(dts) == 1 and dts <= {"float16", "bfloat16"} else None


def plain_fix(path: str, half: str | None, kind: str | None = None, library: bool = True,
              model_dtype: str | None = None) -> str:
    """The plain-PyTorch equivalent of ``keep_fp32`` for the module at ``path``: autocast off around its
    call on an FP32 input; where its weights are stored in ``half`` precision (no autocast to turn off),
    the module converted to FP32 once and its input and output cast where it is called; where it has no
    such weights but the whole model is ``model_dtype`` (a pure half model: :func:`model_half`), its input
    and output cast. ``library``: whether ``kind`` is a torch.nn class (else the body of its forward is
    what to change)."""
    if half:
        return (f"its weights are {half}, so there is no autocast to turn off: `{path}.float()` once (before "
                f"building the optimizer), and where it is called `y = {path}(x.float()).to(x.dtype)` (a weight tied "
                "to another module's, as an LM head's to the embedding, would turn FP32 for both: keep_fp32 keeps the tie)")
    if model_dtype:
        where = (f"where {path} is called, `y = {path}(x.float()).to(x.dtype)`" if library or kind is None else
                 f"in {kind}.forward, begin with `dtype, x = x.dtype, x.float()` and return the result `.to(dtype)`")
        return (f"the model is {model_dtype} with no autocast to turn off: {where} (an output beyond {model_dtype}'s "
                "range overflows again at that cast: the layers after it need FP32 too)")
    if library or kind is None:
        return f"where {path} is called, `with torch.autocast(x.device.type, enabled=False): y = {path}(x.float())`"
    return (f"in {kind}.forward, run the body under `with torch.autocast(x.device.type, enabled=False):` on "
            "`x = x.float()` (and cast the result back if the next layer needs it)")


def is_torch_module(kind: str | None) -> bool:
    """Whether ``kind`` (a class name from the trace) names a torch.nn module class."""
    import torch.nn as nn

    return bool(kind) and isinstance(getattr(nn, kind, None), type)


def root_hint(names, types: Optional[Mapping[str, str]], wrapper: str | None = None) -> str:
    """What ``model`` stands for in a ``keep_fp32(model...)`` snippet: the class of the watched root. Under
    ``ampdoctor run`` the watch roots at the first module the script calls, which may be a part of the object
    the user thinks of as the model (Lightning's ``training_step`` calling ``self.model(x)``: the snippet's
    ``model`` is that inner module, not the LightningModule). A second model's names (``D:net.2``, written
    ``d.net[2]``) say which object ``d`` is. Empty when the wrapper's hint says it already."""
    cls = (types or {}).get("")
    names = list(names)
    if wrapper:
        return ""
    owners = [split_owner(n, types)[0] for n in names]
    if names and all(o is not None for o in owners):
        owner = owners[0]
        if any(o != owner for o in owners):
            return ""
        kind = owner.split("#")[0]
        return f" (`{kind.lower()}`: the {kind} model your script called after the first one watched)"
    if not cls:
        return ""
    return f" (`model`: your {cls} object)"
