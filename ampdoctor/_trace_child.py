"""The trace's writer process (see ``ampdoctor.trace.TraceWriter``): reads messages from stdin and
writes them to the SQLite trace, so that the training process does no SQLite work. No torch, and
the ampdoctor package is not imported (``trace.py`` is loaded from its path): it starts in a
fraction of a second.

Usage: python _trace_child.py TRACE.sqlite PATH/TO/ampdoctor/trace.py

It answers "ready" on stdout once it can write. Messages: 4-byte little-endian payload length, a
kind byte, the payload.
  S  statistics rows: a JSON header line {step, meta, n, w, nf}, then n * w raw float64
  Q  JSON {sql, rows}: rows for an ``executemany`` (blobs as {"$b": hex})
  C  commit
  F  commit, then answer "ok" on stdout
  X  stop: commit and exit
End of input (the training process closed the pipe, or died): commit and exit (a trace deleted
meanwhile is written again: ``trace.keep_if_deleted``). Interrupts are
ignored: a Ctrl-C in the terminal reaches this process too, and what it holds must be written.
"""

import sys

# run as a script, this file's folder (the ampdoctor package) comes first on sys.path, where its
# modules (trace, bisect, ...) would shadow the standard library's for everything imported below
if sys.path and sys.path[0] and __file__.startswith(sys.path[0]):
    del sys.path[0]

import importlib.util  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402

import numpy as np  # noqa: E402


def _read(stream, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = stream.read(n - len(buf))
        if not part:
            return buf
        buf += part
    return buf


def _blob(d: dict):
    return bytes.fromhex(d["$b"]) if len(d) == 1 and "$b" in d else d


def main(db: str, trace_py: str) -> int:
    for sig in (signal.SIGINT, getattr(signal, "SIGTERM", None)):
        if sig is not None:
            signal.signal(sig, signal.SIG_IGN)
    spec = importlib.util.spec_from_file_location("_ampdoctor_trace_child", trace_py)
    trace = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trace)
    con = trace._connect(db)
    opened = trace.file_id(db)
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    try:
        out.write(b"ready\n")  # the sender waits for this before it sends anything
        out.flush()
    except BrokenPipeError:  # the sender ended before it could send anything: nothing to keep
        con.close()
        return 0
    ncols = len(trace.STAT_COLUMNS)
    cache: dict = {}
    meta: list = []
    status = 0
    seen: set[str] = set()  # the errors said so far
    first: dict | None = None  # the first write that failed: kept in the trace's meta, if it still takes it
    step = None  # the step of the last statistics rows received
    full = False  # the disk took no more (see trace.make_room)
    try:
        while True:
            head = _read(inp, 5)
            if len(head) < 5:
                break
            size, kind = int.from_bytes(head[:4], "little"), head[4:5]
            payload = _read(inp, size)
            if len(payload) < size:
                break  # the sender died mid-message: keep what came whole
            try:
                if kind == b"S":
                    if full:  # the disk took no more: only the meta rows are still tried
                        continue
                    line, raw = payload.split(b"\n", 1)
                    h = json.loads(line)
                    step = h["step"]
                    rows = np.frombuffer(raw, dtype=np.float64).reshape(h["n"], h["w"])
                    if h["meta"] is not None:  # None: the same row descriptions as the last step's
                        meta = [tuple(m) for m in h["meta"]]
                    if len(meta) != h["n"]:
                        raise ValueError(f"{h['n']} rows for {len(meta)} row descriptions at step {h['step']}")
                    trace._insert_rows(con, trace._STATS_INSERT, ncols, trace.stat_rows(h["step"], meta, rows, h["nf"]), cache)
                elif kind == b"Q":
                    q = json.loads(payload, object_hook=_blob)
                    if full and q["sql"] != trace.META_INSERT:
                        continue
                    rows = [tuple(r) for r in q["rows"]]
                    if q["sql"] == trace._STATS_INSERT:
                        trace._insert_rows(con, q["sql"], ncols, rows, cache)
                    else:
                        con.executemany(q["sql"], rows)
                elif kind == b"C":
                    con.commit()
                elif kind == b"F":
                    con.commit()
                    out.write(b"ok\n")
                    out.flush()
                elif kind == b"X":
                    break
            except Exception as e:  # a bad row must not lose the rest
                status = 1
                said = f"{type(e).__name__}: {e}"
                first = first or {"error": said, "step": step}
                if not full and trace.disk_failed(e):
                    full = True
                    trace.make_room(con)
                if said not in seen:  # (a full disk fails every write after it: said once)
                    seen.add(said)
                    print(f"ampdoctor trace writer: {said}" + (" (the steps from here on are not written; "
                          "said once)" if "full" in said else ""), file=sys.stderr)
    finally:
        try:
            con.commit()
        except Exception as e:  # (a full disk): what did not fit is lost, the rest is kept
            status = 1
            first = first or {"error": f"{type(e).__name__}: {e}", "step": step}
        trace.note_write_error(con, first)
        trace.keep_if_deleted(con, db, opened)  # its run folder removed mid-run: written again
        con.close()
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
