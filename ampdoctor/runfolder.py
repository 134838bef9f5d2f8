"""The run folder's lock: held by every ``ampdoctor run``/``bisect`` (and ``ampdoctor.bisect(out=...)``)
while it writes into its folder, so that two runs do not mix their traces there. An advisory
``flock`` on ``OUT/.ampdoctor.lock``, which holds the holder's pid and command; the system releases
it when the process ends, however it ends."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

LOCK_NAME = ".ampdoctor.lock"


class FolderHeld(Exception):
    """Another live process holds the folder's lock: ``pid`` (None if it wrote none) and ``command``
    (``run``/``bisect``, or what it wrote)."""

    def __init__(self, folder: Path, pid: int | None, command: str):
        self.folder, self.pid, self.command = folder, pid, command
        who = f"another `ampdoctor {command if command in ('run', 'bisect') else 'run'}`"
        super().__init__(f"{who} (process {pid}) is still writing into {folder}" if pid is not None else
                         f"{who} is still writing into {folder}")


_HELD: list = []  # the open lock files (a lock dies with its file object)


def lock(folder: Path, command: str) -> Callable[[], None]:
    """Take ``folder``'s lock for ``command`` (made if missing); returns what releases it (idempotent).
    :class:`FolderHeld` when another live process holds it."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: no lock (the CLI still checks for a live trace)
        return lambda: None
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    f = open(path, "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        pid, _, held_by = f.read().strip().partition(" ")
        f.close()
        raise FolderHeld(folder, int(pid) if pid.isdigit() else None, held_by) from None
    f.truncate(0)
    f.write(f"{os.getpid()} {command}\n")
    f.flush()
    _HELD.append(f)

    def release() -> None:
        if f not in _HELD:
            return
        _HELD.remove(f)
        try:
            path.unlink()
        except OSError:
            pass
        f.close()

    return release
