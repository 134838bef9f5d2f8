"""Module names as users write them: ``blocks.1.attn`` -> ``model.blocks[1].attn``."""

from __future__ import annotations

import re
from typing import Mapping, Optional

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


_INDEXABLE = ("Sequential", "ModuleList")


def module_expr(name: str, root: str = "model", types: Optional[Mapping[str, str]] = None) -> str:
    """Python expression for a qualified module name (``get_submodule`` when a part is no identifier).

    ``types`` (qualified name -> class name, e.g. the trace's layers) says what a numeric part indexes:
    ``[1]`` in a Sequential/ModuleList, ``["1"]`` in a ModuleDict (``[1]`` is a KeyError there), and
    ``get_submodule`` under any other parent (``add_module("1", ...)``); without it, ``[1]``."""
    if ":" in name:  # a second model watched automatically: ``D:net.2`` -> ``d.net[2]`` (your D object)
        owner, _, name = name.partition(":")
        root = owner.split("#")[0].lower() or root
    if not name or name == "(root)":
        return root
    parts = name.split(".")
    if not all(p.isdigit() or _IDENT.match(p) for p in parts):
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
