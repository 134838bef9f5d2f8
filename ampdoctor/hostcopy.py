"""One step's device data bound for the host: one ``cat`` and one copy per device; on CUDA the
copy goes non-blocking into pinned memory and an event marks its arrival (read later: where the
next step's backward ends if it has arrived by then, else when the backward after starts, or at the
next boundary)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class HostCopy:
    """Pieces of one step bound for the host: one ``cat`` and one copy per device. On CUDA the
    copy goes non-blocking into pinned memory and an event marks its arrival."""

    def __init__(self) -> None:
        self._pieces: dict[torch.device, list[torch.Tensor]] = {}
        self._layout: list[tuple[str, torch.device, int]] = []
        self._host: dict[torch.device, Any] = {}
        self._events: dict[torch.device, Any] = {}
        self.on_cuda = False

    @staticmethod
    def defers(devices: set) -> bool:
        """Whether a copy from ``devices`` goes non-blocking to the host (to be read later)."""
        return any(d.type == "cuda" for d in devices)

    def put(self, what: str, t: torch.Tensor) -> None:
        t = t.reshape(-1).to(torch.float64)
        self._pieces.setdefault(t.device, []).append(t)
        self._layout.append((what, t.device, t.numel()))

    def start(self) -> None:
        for dev, ts in self._pieces.items():
            flat = torch.cat(ts) if len(ts) > 1 else ts[0]
            if dev.type == "cuda":
                self.on_cuda = True
                host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
                host.copy_(flat, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(dev))
                self._host[dev], self._events[dev] = host, ev
            else:
                self._host[dev] = flat.cpu()
        self._pieces.clear()

    def arrived(self) -> bool:
        """Whether the copy has reached the host (no wait; a copy to the CPU has at once)."""
        return all(ev.query() for ev in self._events.values())

    def reader(self):
        """``take(what)``: the next piece, in the order they were put (waits for the copy)."""
        for ev in self._events.values():
            ev.synchronize()
        self._events.clear()
        host = {dev: t.numpy() for dev, t in self._host.items()}
        offsets = {dev: 0 for dev in host}
        it = iter(self._layout)

        def take(what: str) -> np.ndarray:
            w, dev, n = next(it)
            assert w == what, (w, what)
            o = offsets[dev]
            offsets[dev] = o + n
            return host[dev][o:o + n]

        return take
