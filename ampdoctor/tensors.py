"""Finding the tensors inside a module's inputs and outputs (tuples, lists, dicts, dataclasses,
named tuples, HF ``ModelOutput``), with a readable slot name for each."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import torch

_MAX_DEPTH = 4
_MAX_TENSORS = 64  # a module returning a list of 10,000 tensors is not worth recording one by one


def iter_tensors(obj: Any, prefix: str = "", depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(slot, tensor)`` for every tensor nested in ``obj`` (depth-first, bounded)."""
    yield from _walk(obj, prefix, depth, [0])


def _walk(obj: Any, prefix: str, depth: int, count: list) -> Iterator[tuple[str, torch.Tensor]]:
    if count[0] >= _MAX_TENSORS:
        return
    if isinstance(obj, torch.Tensor):
        count[0] += 1
        yield prefix or "out", obj
        return
    if depth >= _MAX_DEPTH or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, tuple) and isinstance(getattr(type(obj), "_fields", None), tuple):
        items = zip(obj._fields, obj)  # a named tuple: its field names, as a dataclass's
    elif isinstance(obj, (tuple, list)):
        items = enumerate(obj)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = ((f.name, getattr(obj, f.name, None)) for f in dataclasses.fields(obj))
    else:
        return
    for key, value in items:
        slot = f"{prefix}.{key}" if prefix else str(key)
        yield from _walk(value, slot, depth + 1, count)


def floating(pairs: Iterator[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    return [(s, t) for s, t in pairs if t.is_floating_point() and t.layout == torch.strided and t.device.type != "meta"]
