"""Module names as users write them: ``blocks.1.attn`` -> ``model.blocks[1].attn``."""

from __future__ import annotations

import re

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def module_expr(name: str, root: str = "model") -> str:
    """Python expression for a qualified module name (``get_submodule`` when a part is no identifier)."""
    if ":" in name:  # a second model watched automatically: ``D:net.2`` -> ``d.net[2]`` (your D object)
        owner, _, name = name.partition(":")
        root = owner.split("#")[0].lower() or root
    if not name or name == "(root)":
        return root
    parts = name.split(".")
    if not all(p.isdigit() or _IDENT.match(p) for p in parts):
        return f"{root}.get_submodule({name!r})"
    out = root
    for p in parts:
        out += f"[{p}]" if p.isdigit() else f".{p}"
    return out
