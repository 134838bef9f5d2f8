"""The SQLite trace store: a background writer and a reader. No torch, no pickle.

One file per process (rank). The writer batches rows from a queue and commits at every
step boundary, so a run that dies (exception, OOM kill, SIGKILL) leaves every committed step
readable. Histograms are stored as little-endian int64 blobs.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import logging
import os
import queue
import shlex
import sqlite3
import threading
import time
import urllib.parse
import weakref
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1

STAT_COLUMNS = (
    "step", "layer", "kind", "slot", "call", "dtype", "numel", "bytes", "nan", "posinf", "neginf",
    "zero", "min", "max", "absmax", "nzmin", "overflow", "subnormal", "flush_to_zero", "hist",
)
# SQLite stores NaN as NULL: a step keeps its loss as text when it is not an ordinary number.

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS layers (
    id INTEGER PRIMARY KEY, name TEXT NOT NULL, type TEXT, ord INTEGER,
    is_leaf INTEGER, parent INTEGER);
CREATE TABLE IF NOT EXISTS stats (
    step INTEGER, layer INTEGER, kind TEXT, slot TEXT, call INTEGER, dtype TEXT,
    numel INTEGER, bytes INTEGER, nan INTEGER, posinf INTEGER, neginf INTEGER, zero INTEGER,
    min REAL, max REAL, absmax REAL, nzmin REAL, overflow INTEGER, subnormal INTEGER,
    flush_to_zero INTEGER, hist BLOB);
CREATE INDEX IF NOT EXISTS stats_layer ON stats(layer, kind);
CREATE TABLE IF NOT EXISTS steps (
    step INTEGER PRIMARY KEY, loss,   scale REAL, skipped INTEGER, optimizer_steps INTEGER,
    recorded INTEGER, wall REAL);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, step INTEGER, kind TEXT, layer TEXT, detail TEXT);
"""

_STOP = object()
_STATS_INSERT = "INSERT INTO stats VALUES"  # rows go in by many-row statements (see _insert_rows)
_STAT_ROWS = "stat rows"  # queue items of raw rows (TraceWriter.add_stat_rows)
_CHUNK_ROWS = 512


def _insert_rows(con: sqlite3.Connection, table_sql: str, ncols: int, rows: list, cache: dict) -> None:
    """Insert ``rows`` (in order) with one statement per chunk of rows rather than one per row:
    the writer thread takes and releases the GIL once per chunk (``sqlite3`` releases it around
    each statement), not once per row, so it interrupts the training thread far less often."""
    try:
        limit = con.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)
    except AttributeError:  # pragma: no cover - Python < 3.11
        limit = 999
    per = max(1, min(_CHUNK_ROWS, limit // ncols))
    row_marks = "(" + ", ".join("?" * ncols) + ")"
    for i in range(0, len(rows), per):
        chunk = rows[i:i + per]
        sql = cache.get(len(chunk))
        if sql is None:
            sql = cache[len(chunk)] = f"{table_sql} " + ", ".join([row_marks] * len(chunk))
        con.execute(sql, tuple(itertools.chain.from_iterable(chunk)))


def stat_rows(step: int, row_meta: Sequence, host_rows: np.ndarray, n_fields: int) -> list[tuple]:
    """The trace's stats rows of one step, built column-wise (hundreds of rows a step): ``row_meta``
    gives (layer, kind, slot, call, dtype, numel, bytes) per row, ``host_rows`` the statistics (the
    first ``n_fields`` columns, then the histogram); the same values as ``int()``/``float()``/
    :func:`hist_blob` per row."""
    count = len(row_meta)
    ints = host_rows[:, [1, 2, 3, 4, 9, 10, 11]].astype(np.int64).T.tolist()
    floats = host_rows[:, 5:9].T.tolist()
    hists = np.ascontiguousarray(host_rows[:, n_fields:]).astype("<i8")
    width = hists.shape[1] * 8
    if width:
        raw = hists.tobytes()
        blobs = [raw[o:o + width] for o in range(0, count * width, width)]
    else:  # pragma: no cover - every format has histogram bins
        blobs = [hist_blob(h) for h in hists]
    return list(zip(itertools.repeat(step, count), *zip(*row_meta), ints[0], ints[1], ints[2], ints[3],
                    floats[0], floats[1], floats[2], floats[3], ints[4], ints[5], ints[6], blobs))


def _connect(path: str | os.PathLike) -> sqlite3.Connection:
    con = sqlite3.connect(str(path), timeout=30, check_same_thread=False)
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("PRAGMA synchronous=NORMAL")
    return con


def file_id(path: str | os.PathLike) -> tuple[int, int] | None:
    """(device, inode) of the file at ``path``, or None where there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


META_INSERT = "INSERT OR REPLACE INTO meta VALUES (?, ?)"


def disk_failed(e: BaseException) -> bool:
    """``e`` says the disk took no more (full, a quota, a file size limit, an I/O error), not a bad row."""
    said = str(e).lower()
    return isinstance(e, sqlite3.OperationalError) and ("full" in said or "i/o" in said)


def make_room(con: sqlite3.Connection) -> None:
    """After a write the disk refused: drop the failed transaction and fold the ``-wal`` into the trace,
    emptying it, so that the few meta rows written from here on (the run's end, its step count, the
    error) still fit; the statistics after it are not tried (they would take that room again)."""
    for sql in ("ROLLBACK", "PRAGMA wal_checkpoint(TRUNCATE)"):
        try:
            con.execute(sql)
        except sqlite3.Error:
            pass


def note_write_error(con: sqlite3.Connection, first: dict | None) -> None:
    """Keep the first write that failed (``{"error", "step"}``: a full disk, say) in the trace's meta as
    ``writer_error``, for the report to say the trace is incomplete; a disk too full for that row
    too leaves the report the step count to go by."""
    if first is None:
        return
    try:
        con.execute("INSERT OR IGNORE INTO meta VALUES ('writer_error', ?)", (json.dumps(first),))
        con.commit()
    except sqlite3.Error:
        pass


def keep_if_deleted(con: sqlite3.Connection, path: str | os.PathLike, opened: tuple[int, int] | None) -> bool:
    """Where the trace ``con`` writes was deleted while it was open (its run folder removed
    mid-run: the connection still holds every row), write it again at ``path``, the folder made
    again, and say so on stderr; True if it did. A file put at ``path`` meanwhile is left alone."""
    if opened is None or file_id(path) is not None:
        return False
    import sys
    try:
        con.commit()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        dst = sqlite3.connect(str(path))
        try:
            con.backup(dst)
        finally:
            dst.close()
    except (OSError, sqlite3.Error) as e:
        print(f"ampdoctor: the trace {path} was deleted while the run wrote it, and could not be written "
              f"again ({type(e).__name__}: {e}); what was recorded is lost", file=sys.stderr)
        return False
    print(f"ampdoctor: the trace {path} was deleted while the run wrote it (its folder removed?); "
          "written again from what the writer held", file=sys.stderr)
    return True


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # exists (another user's), or cannot tell: assume alive
    return True


def _ancestor(pid: int) -> bool:
    """Whether process ``pid`` started this one (its parent, or further up: a DataLoader worker spawned by
    the training process re-runs the script's ``watch()``)."""
    here = os.getppid()
    for _ in range(16):
        if here == pid:
            return True
        if here <= 1:
            return False
        try:  # Linux: the parent's parent, from /proc (elsewhere only the parent is known)
            with open(f"/proc/{here}/stat", "rb") as f:
                here = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


def _uri(path: Path, flag: str) -> str:
    return f"file:{urllib.parse.quote(str(path.resolve()))}?{flag}"


def open_for_reading(path: str | os.PathLike, timeout: float = 30) -> tuple[sqlite3.Connection, Callable[[], None]]:
    """A connection that reads the trace at ``path`` and leaves nothing beside it that was not there,
    and what closes it (use that, not ``con.close()``).

    A trace the user can write is opened as usual (SQLite removes the ``-wal``/``-shm`` it made when
    the last connection closes; a live run's own stay). One in a read-only file or folder is opened
    ``mode=ro`` (a read-only folder where the ``-shm`` cannot be made: ``immutable=1``); the
    ``-wal``/``-shm`` such a connection makes stay behind after it, so the closer removes them. Raises :class:`sqlite3.Error` when none of these can read it."""
    p = Path(path)
    side = [Path(f"{p}{s}") for s in ("-wal", "-shm")]
    before = {s for s in side if s.exists()}
    writable = os.access(p, os.W_OK) and os.access(p.parent, os.W_OK | os.X_OK)
    # (mode=rw: a missing file is an error, not a new empty database)
    tries = ([(_uri(p, "mode=rw"), False)] if writable else []) + [(_uri(p, "mode=ro"), True),
                                                                   (_uri(p, "mode=ro&immutable=1"), True)]
    error: sqlite3.Error | None = None
    for target, read_only in tries:
        con = None
        try:
            con = sqlite3.connect(target, uri=True, timeout=timeout)
            con.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()  # (the file is opened here, not at connect)
        except sqlite3.OperationalError as e:  # cannot write, cannot make the -shm: the next, more read-only way
            error = e
            if con is not None:
                con.close()
            _remove_made(side, before)
            continue
        except BaseException:
            if con is not None:
                con.close()
            _remove_made(side, before)
            raise
        if not read_only:
            return con, con.close
        if "immutable" in target and any(s.name.endswith("-wal") and s.stat().st_size for s in before):
            log.warning("ampdoctor trace: %s is in a read-only folder and its last steps are still in %s-wal, "
                        "which cannot be read from there: copy the folder somewhere writable to see them", p, p)

        def close(con: sqlite3.Connection = con) -> None:
            con.close()
            _remove_made(side, before)

        return con, close
    assert error is not None
    raise error


def _remove_made(side: list[Path], before: set[Path]) -> None:
    """The ``-wal``/``-shm`` a read-only connection made (they were not there before it): removed
    once the ``-wal`` is empty (nothing that a writer added meanwhile is lost)."""
    made = [s for s in side if s not in before and s.exists()]
    wal = next((s for s in made if s.name.endswith("-wal")), None)
    try:
        if wal is not None and wal.stat().st_size:
            return
        for s in made:
            s.unlink()
    except OSError:  # a read-only folder: nothing was made there anyway
        pass


def trace_meta(path: Path) -> dict | None:
    """The ``meta`` table of the ampdoctor trace at ``path`` (a non-empty file), or None when the file
    is not one (not SQLite, or SQLite without ampdoctor's metadata)."""
    meta = None
    try:
        con, close = open_for_reading(path)
        try:
            meta = dict(con.execute("SELECT key, value FROM meta").fetchall())
        finally:
            close()
    except (sqlite3.Error, ValueError, TypeError, OSError):
        pass
    return meta if meta is not None and "schema_version" in meta else None


def trace_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot take a new trace: a non-empty file there that is not an ampdoctor trace,
    which ampdoctor never overwrites (see :func:`_discard_old_trace`). None when there is no file, an
    empty one, or an earlier ampdoctor trace (that one is started afresh)."""
    p = Path(path)
    try:
        if not p.exists() or (p.is_file() and not p.stat().st_size):
            return None
    except OSError:
        return None
    if p.is_dir():
        return f"{p} is a directory, not an ampdoctor trace"
    if trace_meta(p) is None:
        return f"{p} exists and is not an ampdoctor trace (ampdoctor never overwrites it)"
    return None


def live_writer(meta: dict | None) -> int | None:
    """The pid of the process on this host still writing the trace whose metadata is ``meta`` (another
    process than this one), or None."""
    import socket

    try:
        pid = int((meta or {}).get("pid") or 0)
    except ValueError:
        return None
    if (meta or {}).get("status") != "running" or not pid or pid == os.getpid():
        return None
    if meta.get("host") not in (None, socket.gethostname()) or not _pid_alive(pid):
        return None
    return pid


def _discard_old_trace(path: Path) -> int | None:
    """A new trace starts empty: a trace already at ``path`` from an earlier run (the same
    ``--out`` or ``watch(trace=...)`` used twice) is removed, or its steps, rows and events would be
    read back as this run's. Left alone while the process that writes it is still running (a
    spawned DataLoader worker that re-runs the script's ``watch()`` must not wipe its parent's
    trace). A file that is not an ampdoctor trace is never touched: that is an error. Returns the
    pid of that parent (or further up) where it writes the trace, else None."""
    if not path.exists():
        return None
    if path.stat().st_size:
        meta = trace_meta(path) if path.is_file() else None  # (opened once: trace_problem's test, inline)
        if meta is None:
            raise ValueError(f"{trace_problem(path) or path}; pass another trace path")
        pid = live_writer(meta)
        if pid is not None and _ancestor(pid):
            log.info("ampdoctor trace: %s is being written by process %d, which started this one; this process "
                     "writes nothing to it", path, pid)
            return pid
        if pid is not None:  # another run, going on: its steps and this one's would mix in one trace
            raise TraceUnwritable(f"{path} is the trace of a run still going on (process {pid} writes it): give "
                                  "watch(trace=...) (or --out) another path, or wait until that run ends")
    for suffix in ("", "-wal", "-shm"):
        try:
            Path(f"{path}{suffix}").unlink()
        except FileNotFoundError:
            pass
    return None


WRITER_ENV = "AMPDOCTOR_TRACE_WRITER"  # "process" (default) or "thread"
_CHILD = Path(__file__).with_name("_trace_child.py")


def _start_child(path: Path) -> Any:
    """The writer process (``_trace_child.py``, no torch), or None where it cannot start."""
    import subprocess
    import sys
    try:
        return subprocess.Popen([sys.executable, str(_CHILD), str(path), str(Path(__file__))],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
    except Exception as e:  # no interpreter to start, no fork allowed: the thread writes
        log.info("ampdoctor trace: no writer process (%s: %s); writing from a thread", type(e).__name__, e)
        return None


_LIVE: weakref.WeakSet[TraceWriter] = weakref.WeakSet()


def _forget_in_forked_child() -> None:
    """In a process forked from the training process (a DataLoader worker): drop its copy of the
    pipe to the writer process, without writing anything, so that the pipe still ends when the
    training process closes it."""
    for w in list(_LIVE):
        child, w._child = w._child, None
        w._closed = True
        if child is not None:
            try:
                os.close(child.stdin.fileno())
            except Exception:  # pragma: no cover
                pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_forked_child)


_READY_TIMEOUT = 20.0  # seconds the writer process has to say it is ready


def _ready(child: Any) -> bool:
    """Whether the writer process said it is ready (it could import and open the trace): nothing
    is sent before, so nothing is lost to a process that could not start."""
    try:
        import select
        if not select.select([child.stdout], [], [], _READY_TIMEOUT)[0]:
            return False
    except (ImportError, OSError, ValueError):  # no select on pipes (Windows): a blocking read
        pass
    try:
        return child.stdout.readline() == b"ready\n"
    except OSError:  # pragma: no cover
        return False


def _ready_now(child: Any) -> bool | None:
    """Whether the writer process said it is ready, without waiting: None while it has said nothing
    yet, False if it ended or said something else (see :func:`_ready`)."""
    try:
        import select
        if not select.select([child.stdout], [], [], 0)[0]:
            return None if child.poll() is None else False
    except (ImportError, OSError, ValueError):  # no select on pipes (Windows): wait for it
        return _ready(child)
    try:
        return child.stdout.readline() == b"ready\n"
    except OSError:  # pragma: no cover
        return False


def _jsonable(v: Any) -> Any:
    """Row values JSON does not carry: blobs as {"$b": hex} (the writer process turns them back),
    numpy scalars as Python numbers."""
    if isinstance(v, (bytes, bytearray, memoryview)):
        return {"$b": bytes(v).hex()}
    if isinstance(v, np.generic):
        return v.item()
    raise TypeError(f"{type(v).__name__} is not a trace value")


def _message(kind: bytes, payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "little") + kind + payload


class TraceWriter:
    """Appends to a trace from a background thread. All public methods are cheap and never block
    on disk; :meth:`commit` marks a durable point (one per step), :meth:`close` drains and joins.

    By default the SQLite work runs in a separate process (``_trace_child.py``) that the thread
    feeds through a pipe: statistics go as raw float64 rows, so the training process neither
    builds nor binds the ~10K values of a step's rows (SQLite binds them holding the GIL, and
    every torch op of the training thread then waits for it). The process commits what it has
    and exits when the pipe closes, so it also keeps what a killed training process sent. Where
    it cannot start (``AMPDOCTOR_TRACE_WRITER=thread``, or no subprocess), or if it dies, the
    thread writes itself."""

    def __init__(self, path: str | os.PathLike | None, deferred: Callable[[], Path] | None = None):
        """``deferred`` (with ``path`` None): the trace is not made until the first step is added
        (:meth:`start`), when ``deferred()`` gives its path; what is queued until then waits in memory,
        and a writer closed before any step writes nothing at all (see ``Session.__init__``)."""
        self.path = Path(path) if path is not None else None
        # the pid of the process that started this one and writes this trace (a spawned DataLoader worker
        # re-running the script's watch()): this writer then writes nothing (see add_step)
        self.parent_writes: int | None = None
        # bytes queued (the training thread adds) and written (the writer thread adds): their difference
        # is what waits in memory; commit() waits while it is over MAX_PENDING (see _catch_up). waited:
        # seconds the training thread waited for the writer to catch up
        self._queued = self._written = 0
        self.waited = 0.0
        self._error: BaseException | None = None
        self._deferred = deferred
        self._q: queue.Queue = queue.Queue()
        self._closed = False
        self._dirty = False  # rows queued since the last commit marker
        self._child = None
        self._sent_meta: list | None = None  # the row descriptions the writer process holds (sent once while unchanged)
        self._told = False  # (see add_step)
        self._thread: threading.Thread | None = None
        if deferred is None:
            self._open()

    def start(self) -> None:
        """Make a deferred trace now (see ``__init__``) and write what waited for it. A trace that
        cannot be made is said once in the log; nothing is written then."""
        make, self._deferred = self._deferred, None
        if make is None or self._closed:
            return
        try:
            self.path = make()
            self._open()
        except Exception as e:  # (never break the user's training for its trace)
            log.warning("ampdoctor trace: not recorded: %s: %s", type(e).__name__, e)
            self._closed = True

    def _open(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.parent_writes = _discard_old_trace(self.path)
            if self.parent_writes is not None:  # its rows, meta and schema are the parent's: nothing is opened
                self._closed = True
                return
            con = _connect(self.path)
        except TraceUnwritable:
            raise
        except (OSError, sqlite3.Error) as e:
            raise TraceUnwritable(f"cannot write the trace at {self.path} ({type(e).__name__}: {e}): give "
                                  "watch(trace=...) (or --out) a path in a folder this process can write") from e
        con.executescript(_SCHEMA)
        con.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        con.commit()
        con.close()
        # (a deferred trace's queue holds what was queued before it was made: written now)
        self._child = _start_child(self.path) if os.environ.get(WRITER_ENV, "process") != "thread" else None
        if self._child is not None:
            _LIVE.add(self)
        self._thread = threading.Thread(target=self._loop, name="ampdoctor-trace-writer", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    # -- producer side ---------------------------------------------------------------------
    def set_meta(self, **items: Any) -> None:
        rows = [(k, v if isinstance(v, str) else json.dumps(v)) for k, v in items.items()]
        self._put(META_INSERT, rows)

    def add_layers(self, rows: Iterable[Sequence]) -> None:
        self._put("INSERT OR REPLACE INTO layers VALUES (?, ?, ?, ?, ?, ?)", list(rows))

    def add_stats(self, rows: Iterable[Sequence]) -> None:
        self._put(_STATS_INSERT, list(rows))

    def add_stat_rows(self, step: int, row_meta: Sequence, host_rows: np.ndarray, n_fields: int) -> None:
        """A step's statistics rows (see :func:`stat_rows`), built by whoever writes them: the
        writer process, or the writer thread, not the caller."""
        if len(row_meta):
            self._put(_STAT_ROWS, [(step, list(row_meta), np.ascontiguousarray(host_rows, dtype=np.float64), n_fields)])

    def add_step(self, row: Sequence) -> None:
        if self.parent_writes is not None:  # a process the trace's writer started, training: said once, loudly
            if not self._told:
                self._told = True
                import sys
                print(f"ampdoctor: this process ({os.getpid()}) trains a watched model, but {self.path} is the trace "
                      f"of the process that started it ({self.parent_writes}); this process's steps are not "
                      f"recorded: give its watch() its own trace=... path", file=sys.stderr, flush=True)
            return
        if self._deferred is not None:
            self.start()
        row = list(row)
        if isinstance(row[1], float) and row[1] != row[1]:
            row[1] = "nan"
        self._put("INSERT OR REPLACE INTO steps VALUES (?, ?, ?, ?, ?, ?, ?)", [tuple(row)])

    def add_event(self, step: int | None, event: str, layer: str | None = None, **detail: Any) -> None:
        self._put("INSERT INTO events (step, kind, layer, detail) VALUES (?, ?, ?, ?)",
                  [(step, event, layer, json.dumps(detail, default=str))])

    MAX_PENDING = 1 << 30  # bytes of rows the writer may fall behind by before commit() waits for it

    def commit(self) -> None:
        if not self._closed and self._dirty:  # (nothing queued since the last commit: nothing to commit)
            self._dirty = False
            self._q.put(None)
            if self._queued - self._written > self.MAX_PENDING:
                self._catch_up()

    def _catch_up(self) -> None:
        """The writer is more than MAX_PENDING bytes behind (a slow disk, a huge model recorded every
        step): wait at this step boundary until it is within half of that, so that the rows waiting
        in memory stay bounded. Said once; the time is kept in ``waited``."""
        t0 = time.monotonic()
        if not self.waited:
            log.warning("ampdoctor trace: the writer is %.0f MB behind; training waits at step boundaries for it "
                        "to catch up (record less: every=N)", (self._queued - self._written) / 1e6)
        while self._queued - self._written > self.MAX_PENDING // 2 and self._thread is not None and self._thread.is_alive():
            time.sleep(0.005)
        self.waited += max(time.monotonic() - t0, 1e-9)

    def flush(self, timeout: float = 30.0) -> None:
        """Block until everything queued so far is committed (syncs with the writer thread)."""
        if self._closed or self._thread is None or not self._thread.is_alive():
            return
        done = threading.Event()
        self._q.put(done)
        done.wait(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Drain the queue, commit and stop the thread (idempotent; syncs with the writer). Waits as
        long as the writer makes progress; gives up after ``timeout`` seconds without any, saying
        how much was not written."""
        if self._closed:
            return
        self._closed = True
        if self._thread is None:  # a deferred trace that no step started: nothing is made
            self._deferred, self._q = None, queue.Queue()
            return
        self._q.put(_STOP)
        last, since = self._written, time.monotonic()
        while self._thread.is_alive():
            self._thread.join(min(1.0, timeout))
            if self._written != last:
                last, since = self._written, time.monotonic()
            elif time.monotonic() - since >= timeout:
                log.warning("ampdoctor trace: the writer made no progress for %.0f s; %.1f MB of rows for %s "
                            "are not written", timeout, (self._queued - self._written) / 1e6, self.path)
                break
        try:
            atexit.unregister(self.close)
        except Exception:  # pragma: no cover - interpreter shutting down
            pass
        if self._error is not None:
            log.warning("ampdoctor trace writer failed: %s", self._error)

    def _put(self, sql: str, rows: list) -> None:
        if self._closed:
            log.debug("trace closed; dropped %d rows", len(rows))
            return
        if rows:
            self._queued += _item_bytes(sql, rows)
            self._q.put((sql, rows))
            self._dirty = True

    # -- consumer thread -------------------------------------------------------------------
    def _loop(self) -> None:
        con = None
        opened = None  # the file con opened (see keep_if_deleted)
        first = None  # the first write that failed (see note_write_error)
        full = False  # the disk took no more (see make_room)
        last_step = None  # the step of the last statistics rows written
        pending = 0
        stats_sql: dict[int, str] = {}
        # Until the writer process says it is ready (its start takes about half a second), this thread
        # writes itself, committing as it would: a training process killed meanwhile keeps its steps.
        waiting = self._child is not None
        deadline = time.monotonic() + _READY_TIMEOUT
        try:
            size = 0
            while True:
                self._written += size  # (the item before this one is written, or sent to the writer process)
                item = self._q.get()
                size = 0 if item is None or item is _STOP or isinstance(item, threading.Event) else _item_bytes(*item)
                if waiting:
                    ready = _ready_now(self._child)
                    if ready is None and time.monotonic() > deadline:
                        ready = False
                    if ready is False:
                        log.info("ampdoctor trace: the writer process did not start; writing from a thread")
                        child, self._child, waiting = self._child, None, False
                        try:
                            child.kill()
                            child.wait(5)
                        except Exception:  # pragma: no cover
                            pass
                    elif ready:
                        waiting = False
                        if con is not None:  # what this thread wrote is committed before the process writes on
                            try:
                                con.commit()
                            except sqlite3.Error:  # (a full disk: said below, as the first write that failed)
                                pass
                            note_write_error(con, first)
                            con.close()
                            con, pending = None, 0
                if self._child is not None and not waiting:
                    try:
                        if self._feed(item):
                            break
                        continue
                    except (OSError, ValueError) as e:  # the process died: write from here on
                        log.warning("ampdoctor trace: the writer process stopped (%s); writing from a thread", e)
                        self._child = None
                if con is None:
                    con = _connect(self.path)
                    opened = file_id(self.path)
                if item is _STOP:
                    break
                sql, rows = (None, []) if item is None or isinstance(item, threading.Event) else item
                try:
                    if isinstance(item, threading.Event):
                        pending = 0
                        try:
                            con.commit()
                        finally:
                            item.set()
                        continue
                    if item is None:
                        if pending:
                            pending = 0
                            con.commit()
                        continue
                    if full and sql != META_INSERT:  # the disk took no more: only the meta rows are still tried
                        continue
                    last_step = _step_of(sql, rows) if sql in (_STAT_ROWS, _STATS_INSERT) else last_step
                    if sql is _STAT_ROWS:
                        for step, meta, host, nf in rows:
                            _insert_rows(con, _STATS_INSERT, len(STAT_COLUMNS), stat_rows(step, meta, host, nf), stats_sql)
                    elif sql is _STATS_INSERT:
                        _insert_rows(con, sql, len(STAT_COLUMNS), rows, stats_sql)
                    else:
                        con.executemany(sql, rows)
                    pending += len(rows)
                except sqlite3.Error as e:  # a bad row, a full disk: the rest is still tried
                    if self._error is None:
                        log.warning("ampdoctor trace: %s (the rows from here on may not be written; said once)", e)
                        at = _step_of(sql, rows)
                        first = {"error": f"{type(e).__name__}: {e}", "step": at if at is not None else last_step}
                    self._error = e
                    if disk_failed(e) and not full:
                        full, pending = True, 0
                        make_room(con)
        except BaseException as e:  # pragma: no cover
            self._error = e
        finally:
            if con is not None:
                try:
                    con.commit()
                except Exception:
                    pass
                try:
                    note_write_error(con, first)
                    keep_if_deleted(con, self.path, opened)
                    con.close()
                except Exception:
                    pass
            self._end_child(never_ready=waiting)

    def _feed(self, item: Any) -> bool:
        """Send one queue item to the writer process; True at the end."""
        child = self._child
        w = child.stdin
        if item is _STOP:
            self._end_child()
            return True
        if isinstance(item, threading.Event):
            w.write(_message(b"F", b""))
            w.flush()
            if child.stdout.readline() != b"ok\n":  # it committed everything before
                raise OSError("no answer from the writer process")
            item.set()
            return False
        if item is None:
            msg = _message(b"C", b"")
        else:
            sql, rows = item
            if sql is _STAT_ROWS:
                parts = []
                for step, meta, host, nf in rows:
                    same = meta == self._sent_meta  # most steps record the same rows as the last one
                    if not same:
                        self._sent_meta = meta
                    head = {"step": step, "meta": None if same else meta, "n": host.shape[0], "w": host.shape[1], "nf": nf}
                    parts.append(_message(b"S", json.dumps(head).encode() + b"\n" + host.tobytes()))
                msg = b"".join(parts)
            else:
                msg = _message(b"Q", json.dumps({"sql": sql, "rows": rows}, default=_jsonable).encode())
        w.write(msg)
        w.flush()  # a process that died fails this item, which the thread then writes
        return False

    def _end_child(self, never_ready: bool = False) -> None:
        child, self._child = self._child, None
        if child is None:
            return
        if never_ready:  # it was sent nothing (this thread wrote everything): not waited for, were it hung
            try:
                child.kill()
                child.wait(5)
                child.stdin.close()
                child.stdout.close()
            except Exception:  # pragma: no cover
                pass
            return
        try:
            try:  # "stop" (processes forked meanwhile may still hold the pipe: no end of input yet)
                child.stdin.write(_message(b"X", b""))
                child.stdin.flush()
            except OSError:
                pass
            child.stdin.close()
            child.wait(30)
            child.stdout.close()
        except Exception as e:  # pragma: no cover
            log.warning("ampdoctor trace: the writer process did not finish: %s", e)
        if child.returncode:
            log.warning("ampdoctor trace: the writer process exited with status %s", child.returncode)


def _item_bytes(sql: Any, rows: list) -> int:
    """About how much memory a queue item holds: raw statistics rows by their arrays, other rows at
    about 200 bytes each."""
    if sql is _STAT_ROWS:
        return sum(host.nbytes + 64 * len(meta) for _, meta, host, _ in rows)
    return 200 * len(rows)


def _step_of(sql: Any, rows: list) -> int | None:
    """The step of a queue item's statistics rows, where it has one."""
    try:
        return int(rows[0][0]) if sql is _STAT_ROWS or sql is _STATS_INSERT else None
    except (IndexError, TypeError, ValueError):
        return None


class TraceUnwritable(OSError):
    """The trace's path cannot be made or opened for writing (a file where a folder should be, no
    permission, a read-only filesystem)."""


def hist_blob(counts: Sequence[float] | np.ndarray) -> bytes:
    return np.asarray(counts, dtype="<i8").tobytes()


def hist_from_blob(blob: bytes | None) -> np.ndarray:
    if not blob:
        return np.zeros(0, dtype=np.int64)
    return np.frombuffer(blob, dtype="<i8").copy()


def _rank_of(p: Path) -> tuple[int, str]:
    """``trace.sqlite`` is rank 0, ``trace.rankN.sqlite`` rank N."""
    parts = p.name.split(".")
    for part in parts:
        if part.startswith("rank") and part[4:].isdigit():
            return int(part[4:]), p.name
    return 0, p.name


def _run_of(p: Path) -> str:
    """The run a trace file belongs to: its name without the rank (``run.rank1.sqlite`` -> ``run.sqlite``)."""
    return ".".join(part for part in p.name.split(".") if not (part.startswith("rank") and part[4:].isdigit()))


def find_traces(path: str | os.PathLike) -> list[Path]:
    """Trace files of a run: the file itself, or the traces in a run folder: every ``trace*.sqlite``
    (``ampdoctor run``'s), else the ampdoctor traces among its ``*.sqlite`` (a name given to
    ``watch(trace=...)``: ``run.sqlite``, ``run.rank1.sqlite``), when they are the ranks of one run."""
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("trace*.sqlite"), key=_rank_of)
        if files:
            return files
        ours = [f for f in sorted(p.glob("*.sqlite")) if f.is_file() and trace_meta(f) is not None]
        runs = sorted({_run_of(f) for f in ours})
        if len(runs) > 1:
            raise FileNotFoundError(f"{p} holds the traces of {len(runs)} runs ({', '.join(runs)}); pass the one to show "
                                    f"(e.g. `ampdoctor report {shlex.quote(str(p / runs[0]))}`)")
        if not ours:
            raise FileNotFoundError(f"no ampdoctor trace (*.sqlite) in {p}; pass a run folder made by `ampdoctor run` or "
                                    "a .sqlite trace")
        return sorted(ours, key=_rank_of)
    if not p.exists():
        raise FileNotFoundError(f"{p} does not exist; pass a run folder or a .sqlite trace")
    return [p]


def rank_siblings(path: str | os.PathLike) -> dict[int, Path]:
    """The rank traces of the run that the trace file ``path`` belongs to, by rank: the files beside it
    of the same name but the rank (``trace.sqlite``, ``trace.rank1.sqlite``, ...)."""
    p = Path(path)
    run = _run_of(p)
    stem, dot, suffix = run.rpartition(".")
    pattern = f"{stem}.rank*.{suffix}" if dot else f"{run}.rank*"
    found = {_rank_of(f)[0]: f for f in p.parent.glob(pattern) if _run_of(f) == run and f.is_file()}
    base = p.parent / run
    if base.is_file():
        found.setdefault(0, base)
    found[_rank_of(p)[0]] = p
    return dict(sorted(found.items()))


class TraceReader:
    """Read-only view of one trace file. Every method returns plain Python/numpy data."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"trace {self.path} does not exist")
        try:
            self._con, self._close = open_for_reading(self.path)
        except sqlite3.DatabaseError as e:
            raise ValueError(f"{self.path} is not an ampdoctor trace ({e})") from e
        self._con.row_factory = sqlite3.Row
        try:
            version = self.meta().get("schema_version")
        except sqlite3.DatabaseError as e:
            self.close()
            raise ValueError(f"{self.path} is not an ampdoctor trace ({e})") from e
        if version is None:
            self.close()
            raise ValueError(f"{self.path} is not an ampdoctor trace (no schema_version)")
        if int(version) > SCHEMA_VERSION:
            self.close()
            raise ValueError(f"{self.path} has trace schema {version}; this ampdoctor reads <= {SCHEMA_VERSION}: upgrade ampdoctor")

    def close(self) -> None:
        self._close()

    def __enter__(self) -> TraceReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def meta(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in self._con.execute("SELECT key, value FROM meta"):
            try:
                out[k] = json.loads(v)
            except (TypeError, ValueError):
                out[k] = v
        return out

    def layers(self) -> list[dict]:
        return [dict(r) for r in self._con.execute("SELECT * FROM layers ORDER BY ord, id")]

    def steps(self) -> list[dict]:
        out = []
        for r in self._con.execute("SELECT * FROM steps ORDER BY step"):
            d = dict(r)
            if isinstance(d["loss"], str):
                d["loss"] = float(d["loss"])
            out.append(d)
        return out

    def events(self, kind: str | None = None) -> list[dict]:
        sql, args = "SELECT * FROM events", ()
        if kind:
            sql, args = sql + " WHERE kind = ?", (kind,)
        out = []
        for r in self._con.execute(sql + " ORDER BY id", args):
            d = dict(r)
            d["detail"] = json.loads(d["detail"]) if d["detail"] else {}
            out.append(d)
        return out

    def stats(self, *, kind: str | None = None, layer: int | None = None, with_hist: bool = False) -> list[dict]:
        cols = [c for c in STAT_COLUMNS if with_hist or c != "hist"]
        sql = f"SELECT {', '.join(cols)} FROM stats"
        where, args = [], []
        if kind:
            where.append("kind = ?")
            args.append(kind)
        if layer is not None:
            where.append("layer = ?")
            args.append(layer)
        if where:
            sql += " WHERE " + " AND ".join(where)
        rows = []
        for r in self._con.execute(sql + " ORDER BY step, rowid", args):
            d = dict(r)
            if with_hist:
                d["hist"] = hist_from_blob(d["hist"])
            rows.append(d)
        return rows

    # -- aggregated and streamed reads (the report of a large trace: no Python object per row) -------
    @contextlib.contextmanager
    def snapshot(self) -> Iterator[TraceReader]:
        """One read transaction around the reads made inside: they all see the trace as the first of
        them found it, while a live run goes on committing steps (nothing more inside another one)."""
        if self._con.in_transaction:
            yield self
            return
        self._con.execute("BEGIN")
        try:
            yield self
        finally:
            self._con.execute("COMMIT")

    def _tuples(self, sql: str, args: Sequence = ()) -> sqlite3.Cursor:
        cur = self._con.cursor()
        cur.row_factory = None  # plain tuples: no Row object per row
        return cur.execute(sql, tuple(args))

    def stat_groups(self) -> list[dict]:
        """The stats rows totalled in SQL per ``(layer, kind, dtype)``, one dict per group: ``rows``;
        the sums of ``numel``, ``overflow``, ``subnormal``, ``flush_to_zero``, ``nan``, ``posinf``,
        ``neginf`` and ``bytes``; ``absmax``, the largest absmax (NULL, a NaN, read as 0.0);
        ``first_bad``, the first step of a row with NaN, Inf or overflow (None: no such row);
        ``first_step``; ``steps``, how many distinct steps; ``min_call``/``max_call``, and
        ``null_calls``, rows without a call index; ``min``/``max``, the smallest and largest finite
        value (None: no finite value; a row with none holds min +inf and max -inf, or NULL, and is left
        out). In no particular order."""
        cols = ("layer", "kind", "dtype", "rows", "numel", "overflow", "subnormal", "flush_to_zero", "nan", "posinf",
                "neginf", "bytes", "absmax", "first_bad", "first_step", "steps", "min_call", "max_call", "null_calls",
                "min", "max")
        # NOT INDEXED: a scan and a sort; the (layer, kind) index would read the table in random order
        sql = ("SELECT layer, kind, dtype, COUNT(*), SUM(numel), SUM(overflow), SUM(subnormal), SUM(flush_to_zero), "
               "SUM(nan), SUM(posinf), SUM(neginf), SUM(bytes), MAX(COALESCE(absmax, 0.0)), "
               "MIN(CASE WHEN nan OR posinf OR neginf OR overflow THEN step END), MIN(step), COUNT(DISTINCT step), "
               "MIN(call), MAX(call), SUM(call IS NULL), MIN(CASE WHEN min <= max THEN min END), "
               "MAX(CASE WHEN min <= max THEN max END) FROM stats NOT INDEXED GROUP BY layer, kind, dtype")
        return [dict(zip(cols, r)) for r in self._tuples(sql)]

    def step_count(self, layer: int, kind: str) -> int:
        """How many distinct steps have rows of ``layer`` and ``kind``."""
        return self._tuples("SELECT COUNT(DISTINCT step) FROM stats WHERE layer IS ? AND kind IS ?",
                            (layer, kind)).fetchone()[0]

    def calls_per_step(self, layer: int, kind: str) -> int:
        """The most distinct ``call`` indices (a missing one counting as one more) among the rows of
        ``layer`` and ``kind`` of one step (0 when there is no such row)."""
        sql = ("SELECT MAX(n) FROM (SELECT COUNT(DISTINCT call) + MAX(call IS NULL) AS n FROM stats "
               "WHERE layer IS ? AND kind IS ? GROUP BY step)")
        return self._tuples(sql, (layer, kind)).fetchone()[0] or 0

    def first_rowid(self, layer: int, kind: str, step: int, dtype: Any = ...) -> int | None:
        """The first row (``rowid``) of ``layer`` and ``kind`` at ``step``, of ``dtype`` when given:
        with the step, where those rows first come in the ``ORDER BY step, rowid`` of :meth:`stats`."""
        sql, args = "SELECT MIN(rowid) FROM stats WHERE layer IS ? AND kind IS ? AND step IS ?", [layer, kind, step]
        if dtype is not ...:
            sql += " AND dtype IS ?"
            args.append(dtype)
        return self._tuples(sql, args).fetchone()[0]

    def nonfinite_steps(self, kinds: Sequence[str]) -> set[int]:
        """Steps with a row of one of ``kinds`` that holds NaN or Inf."""
        sql = f"SELECT DISTINCT step FROM stats WHERE kind IN ({', '.join('?' * len(kinds))}) AND (nan OR posinf OR neginf)"
        return {r[0] for r in self._tuples(sql, kinds)}

    def repeated_rows(self, kind: str, dtypes: Sequence[str]) -> np.ndarray:
        """The rowids of the rows of ``kind`` in ``dtypes`` that are not the first of their step, layer and
        slot: the weight gradients read again after each backward of an accumulating step, each a sum of
        the micro-batches so far."""
        marks = ", ".join("?" * len(dtypes))
        sql = (f"SELECT rowid FROM stats WHERE kind = ? AND dtype IN ({marks}) AND rowid NOT IN "
               f"(SELECT MIN(rowid) FROM stats WHERE kind = ? GROUP BY step, layer, slot)")
        return np.fromiter((r[0] for r in self._tuples(sql, (kind, *dtypes, kind))), dtype=np.int64)

    def step_cells(self, kind: str) -> dict[str, np.ndarray]:
        """The rows of ``kind`` totalled in SQL per ``(layer, step)``, as numpy columns: ``layer``,
        ``step``; ``absmax``, the largest (NULL, a NaN, read as 0.0); ``bad``, a row held NaN or Inf;
        ``numel`` and ``under`` (subnormal plus flushed values), summed (as float64)."""
        sql = ("SELECT layer, step, MAX(COALESCE(absmax, 0.0)), MAX(COALESCE(nan OR posinf OR neginf, 0)), "
               "SUM(numel), SUM(subnormal + flush_to_zero) FROM stats NOT INDEXED WHERE kind = ? GROUP BY layer, step")
        cur = self._tuples(sql, (kind,))
        parts: list[np.ndarray] = []
        while True:  # in chunks: numpy columns, not a tuple per cell, in memory
            rows = cur.fetchmany(1 << 14)
            if not rows:
                break
            parts.append(np.array(rows, dtype=np.float64).reshape(len(rows), 6))
        cells = np.concatenate(parts) if parts else np.zeros((0, 6))
        return {"layer": cells[:, 0].astype(np.int64), "step": cells[:, 1].astype(np.int64), "absmax": cells[:, 2],
                "bad": cells[:, 3] != 0, "numel": cells[:, 4], "under": cells[:, 5]}

    def hist_sums(self, n_bins: int, kinds: Sequence[str] | None = None, *,
                  chunk_rows: int = 1 << 14) -> dict[tuple[int, str], np.ndarray]:
        """Per ``(layer, kind)``: the sum (int64) of the histograms of ``n_bins`` bins, rows whose
        histogram has another length (or none) left out; ``kinds``: the trace's, when known (else
        read first). Streamed: at most ``chunk_rows`` histograms in memory at once, no Python object
        made per row but the (group, blob) pair the database driver gives."""
        kinds = list(kinds) if kinds is not None else [r[0] for r in self._tuples("SELECT DISTINCT kind FROM stats")]
        if not kinds:
            return {}
        k = len(kinds)
        sums: dict[int, np.ndarray] = {}
        for c in self.stat_chunks(("layer",), kinds=kinds, hist_bins=n_bins, chunk_rows=chunk_rows):
            groups, at = np.unique(c["layer"] * k + c["kind"], return_inverse=True)
            part = np.zeros((len(groups), n_bins), dtype=np.int64)
            np.add.at(part, at.reshape(-1), c["hist"])
            for g, row in zip(groups.tolist(), part):
                got = sums.get(g)
                sums[g] = row if got is None else got + row
        return {(g // k, kinds[g % k]): row for g, row in sums.items()}

    _INT_COLUMNS = frozenset(("step", "layer", "call", "numel", "bytes", "nan", "posinf", "neginf", "zero", "overflow",
                              "subnormal", "flush_to_zero", "rowid"))
    _FLOAT_COLUMNS = frozenset(("min", "max", "absmax", "nzmin"))

    def stat_chunks(self, columns: Sequence[str], *, kinds: Sequence[str] | None = None, hist_bins: int | None = None,
                    chunk_rows: int = 1 << 14) -> Iterator[dict[str, np.ndarray]]:
        """The stats rows as numpy columns, ``chunk_rows`` rows at a time, in the table's order (not by
        step; ``rowid`` gives the order). ``columns``: stats columns but ``kind``, ``dtype``, ``slot``
        and ``hist``, or ``rowid``; the integer ones as int64 (NULL not allowed), the others as float64
        (NULL as NaN). ``kinds``: only the rows of these kinds, with a column ``kind`` of each row's
        index in ``kinds``. ``hist_bins``: only the rows whose histogram has that many bins, with a
        column ``hist``, an (n, hist_bins) int64 array."""
        unknown = [c for c in columns if c not in self._INT_COLUMNS | self._FLOAT_COLUMNS]
        if unknown:
            raise ValueError(f"not a numeric stats column: {', '.join(unknown)}")
        names, select, where, args = list(columns), list(columns), [], []
        if kinds is not None:
            select.append("CASE kind " + " ".join(f"WHEN ? THEN {i}" for i in range(len(kinds))) + " END")
            names.append("kind")
            where.append(f"kind IN ({', '.join('?' * len(kinds))})")
            args += list(kinds) * 2
        if hist_bins is not None:
            select.append("hist")
            where.append("length(hist) = ?")
            args.append(8 * hist_bins)
        sql = f"SELECT {', '.join(select)} FROM stats NOT INDEXED" + (" WHERE " + " AND ".join(where) if where else "")
        cur = self._tuples(sql, args)
        while True:
            rows = cur.fetchmany(chunk_rows)
            if not rows:
                break
            n = len(rows)  # (integer columns straight from the rows; float ones through np.array: NULL as NaN)
            out = {name: np.array([r[i] for r in rows], dtype=np.float64) if name in self._FLOAT_COLUMNS else
                   np.fromiter((r[i] for r in rows), dtype=np.int64, count=n) for i, name in enumerate(names)}
            if hist_bins is not None:
                out["hist"] = np.frombuffer(b"".join([r[-1] for r in rows]), dtype="<i8").reshape(n, hist_bins)
            yield out

