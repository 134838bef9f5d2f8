"""The trace writer: the writer process (default) and the in-thread writer give the same trace;
a writer process that cannot start or dies leaves the thread writing, nothing lost after it."""

import os
import sqlite3
import sys
import time

import numpy as np
import pytest
import torch
from helpers import train
from torch import nn

import ampdoctor
from ampdoctor import trace as trace_mod
from ampdoctor.trace import TraceReader, TraceWriter, stat_rows


def _record(path, monkeypatch, mode):
    monkeypatch.setenv(trace_mod.WRITER_ENV, mode)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 1))
    with ampdoctor.watch(model, trace=str(path)):
        torch.manual_seed(1)
        train(model, 3)
    r = TraceReader(path)
    stats = sorted((tuple(s[c] for c in trace_mod.STAT_COLUMNS if c != "hist"), s["hist"].tolist()) for s in r.stats(with_hist=True))
    steps = [tuple(s.values()) for s in r.steps()]
    events = [(e["step"], e["kind"], e["layer"]) for e in r.events()]
    layers = sorted(tuple(v.values()) for v in r.layers())
    return stats, [s[:-1] for s in steps], events, layers, r.meta()["status"]


def test_process_and_thread_writers_write_the_same_trace(tmp_path, monkeypatch):
    got = _record(tmp_path / "p.sqlite", monkeypatch, "process")
    ref = _record(tmp_path / "t.sqlite", monkeypatch, "thread")
    assert got == ref
    assert len(got[0]) > 30 and got[4] == "finished"


def _rows(n, width, seed):
    g = np.random.default_rng(seed)
    host = g.normal(size=(n, width))
    host[:, :5] = g.integers(0, 100, size=(n, 5))
    host[:, 9:] = g.integers(0, 1000, size=(n, width - 9))
    meta = [(i, "activation", "out", 0, "float16", 10, 20) for i in range(n)]
    return meta, host


def test_raw_rows_round_trip_and_flush(tmp_path):
    w = TraceWriter(tmp_path / "t.sqlite")
    assert w._child is not None  # the default: a writer process
    meta, host = _rows(7, 12 + 42, 0)
    w.add_stat_rows(3, meta, host, 12)
    w.add_stats([(4, 0, "weight", "w", 0, "float32", 1, 4, 0, 0, 0, 0, -1.0, 2.0, 2.0, 0.5, 0, 0, 0,
                  np.arange(3, dtype="<i8").tobytes())])
    w.add_step((3, float("nan"), float("inf"), 1, 2, 1, 0.0))
    w.commit()
    w.flush()  # returns once the process committed: readable now, before close()
    r = TraceReader(tmp_path / "t.sqlite")
    got = sorted(tuple(s[c] for c in trace_mod.STAT_COLUMNS if c != "hist") + (s["hist"].tolist(),) for s in r.stats(with_hist=True))
    want = sorted(row[:-1] + (np.frombuffer(row[-1], dtype="<i8").tolist(),) for row in stat_rows(3, meta, host, 12))
    want.append((4, 0, "weight", "w", 0, "float32", 1, 4, 0, 0, 0, 0, -1.0, 2.0, 2.0, 0.5, 0, 0, 0, [0, 1, 2]))
    assert got == sorted(want)
    assert r.steps()[0]["scale"] == float("inf")
    w.close()
    assert w._child is None


def test_row_descriptions_sent_once_while_unchanged(tmp_path):
    """The writer process gets a step's row descriptions only when they differ from the last
    step's; steps whose rows change (another row count, other sizes) and change back are written
    with their own descriptions."""
    w = TraceWriter(tmp_path / "t.sqlite")
    assert w._child is not None
    metas = []
    for step, (n, numel) in enumerate([(5, 10), (5, 10), (6, 10), (6, 11), (5, 10), (5, 10)]):
        meta, host = _rows(n, 12 + 42, step)
        meta = [m[:5] + (numel, 2 * numel) for m in meta]
        metas.append((step, meta, host))
        w.add_stat_rows(step, [tuple(m) for m in meta], host, 12)
    w.commit()
    w.flush()
    r = TraceReader(tmp_path / "t.sqlite")
    got = sorted(tuple(s[c] for c in trace_mod.STAT_COLUMNS if c != "hist") + (s["hist"].tolist(),) for s in r.stats(with_hist=True))
    want = sorted(row[:-1] + (np.frombuffer(row[-1], dtype="<i8").tolist(),)
                  for step, meta, host in metas for row in stat_rows(step, meta, host, 12))
    assert got == want and len(got) == 32
    w.close()


def test_no_writer_process_the_thread_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-such-python"))
    w = TraceWriter(tmp_path / "t.sqlite")
    assert w._child is None
    meta, host = _rows(3, 20, 1)
    w.add_stat_rows(0, meta, host, 12)
    w.close()
    assert len(TraceReader(tmp_path / "t.sqlite").stats()) == 3


@pytest.mark.parametrize("when", ["at start", "midway"])
def test_writer_process_that_dies_leaves_the_thread_writing(tmp_path, when):
    w = TraceWriter(tmp_path / "t.sqlite")
    meta, host = _rows(4, 20, 2)
    if when == "midway":
        w.add_stat_rows(0, meta, host, 12)
        w.commit()
        w.flush()
    w._child.kill()
    w._child.wait()
    w.add_stat_rows(1, meta, host, 12)
    w.commit()
    w.close()
    steps = [s["step"] for s in TraceReader(tmp_path / "t.sqlite").stats()]
    assert steps.count(1) == 4 and steps.count(0) == (4 if when == "midway" else 0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_process_neither_writes_nor_keeps_the_writer_waiting(tmp_path):
    """A DataLoader worker forked from the training process holds a copy of everything: it must not
    write to the trace, and the trace must close while it still runs."""
    w = TraceWriter(tmp_path / "t.sqlite")
    meta, host = _rows(2, 20, 3)
    pid = os.fork()
    if pid == 0:  # the forked "worker"
        try:
            w.add_stat_rows(9, meta, host, 12)  # dropped: the fork has no writer
            w.commit()
            time.sleep(4)
        finally:
            os._exit(0)
    try:
        t0 = time.perf_counter()
        w.add_stat_rows(0, meta, host, 12)
        w.close()
        took = time.perf_counter() - t0
    finally:
        os.waitpid(pid, 0)
    assert took < 3
    assert [s["step"] for s in TraceReader(tmp_path / "t.sqlite").stats()] == [0, 0]


@pytest.mark.parametrize("script", ["import sys; sys.exit(3)", "import time; time.sleep(60)"])
def test_a_writer_process_that_never_gets_ready_loses_nothing(tmp_path, monkeypatch, script):
    """A child that dies at start (say numpy cannot be imported there) or hangs: nothing was sent to
    it before its "ready", so the thread writes everything, the first rows included."""
    bad = tmp_path / "child.py"
    bad.write_text(script + "\n")
    monkeypatch.setattr(trace_mod, "_CHILD", bad)
    monkeypatch.setattr(trace_mod, "_READY_TIMEOUT", 1.0)
    w = TraceWriter(tmp_path / "t.sqlite")
    w.set_meta(status="running")
    meta, host = _rows(3, 20, 4)
    w.add_stat_rows(0, meta, host, 12)
    w.close()
    r = TraceReader(tmp_path / "t.sqlite")
    assert len(r.stats()) == 3 and r.meta()["status"] == "running"


def test_a_second_run_into_the_same_trace_starts_empty(tmp_path):
    # `ampdoctor run --out DIR` twice, or `watch(model, trace="run.sqlite")` in a script run twice: the
    # first run's rows, steps and events (its "Training broke at step ...") must not be read as the second's
    path = tmp_path / "run.sqlite"

    def one_run(scale):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        with ampdoctor.watch(model, trace=str(path)) as w:
            for _ in range(3):
                model(torch.randn(2, 4) * scale).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        return w.report()

    broken = one_run(1e20)  # its activations overflow and its weights go non-finite
    assert broken.diagnosis.broke
    healthy = one_run(1.0)
    assert not healthy.diagnosis.broke, healthy.diagnosis.lines
    assert max(r.absmax for r in healthy.rows("activation")) < 100
    assert len(TraceReader(path).stats(kind="activation")) == 2 * 3


def test_a_file_that_is_not_a_trace_is_never_overwritten(tmp_path):
    path = tmp_path / "model.pt"
    path.write_bytes(b"not a trace" * 100)
    with pytest.raises(ValueError, match="not an ampdoctor trace"):
        TraceWriter(path)
    assert path.read_bytes() == b"not a trace" * 100


def test_what_comes_before_the_writer_process_is_ready_is_committed_at_once(tmp_path, monkeypatch):
    """The writer process takes about half a second to start. What the training sent meanwhile waited
    for it in the training process's memory, so a run killed in its first half second (an early NaN
    check that calls os.kill, the OOM killer) lost every step. The thread now writes it itself, and
    hands over to the process once it is ready."""
    slow = tmp_path / "slow_child.py"
    slow.write_text(f"import runpy, sys, time\ntime.sleep(3)\nrunpy.run_path({str(trace_mod._CHILD)!r}, run_name='__main__')\n")
    monkeypatch.setattr(trace_mod, "_CHILD", slow)
    w = TraceWriter(tmp_path / "t.sqlite")
    w.set_meta(status="running")
    meta, host = _rows(3, 20, 4)
    w.add_stat_rows(0, meta, host, 12)
    w.commit()
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and not TraceReader(tmp_path / "t.sqlite").stats():
        time.sleep(0.05)
    assert w._child is not None and w._child.poll() is None  # the process is still starting
    assert len(TraceReader(tmp_path / "t.sqlite").stats()) == 3  # committed already, by the thread
    time.sleep(3)  # the process is ready now: it writes the rest
    w.add_stat_rows(1, meta, host, 12)
    w.commit()
    w.flush()
    assert w._child is not None  # (it took over)
    w.close()
    r = TraceReader(tmp_path / "t.sqlite")
    assert [s["step"] for s in r.stats()] == [0, 0, 0, 1, 1, 1] and r.meta()["status"] == "running"


class _FullDisk:
    """The writer thread's connection on a disk with room for the meta rows only: a commit with other
    rows in it fails as a full disk does, until they are rolled back."""

    def __init__(self, con):
        self.con, self.dirty = con, False

    def _took(self, sql):
        if sql.lstrip().upper() == "ROLLBACK":
            self.dirty = False
        elif sql.lstrip().upper().startswith("INSERT") and " INTO meta " not in sql:
            self.dirty = True

    def execute(self, sql, *a):
        self._took(sql)
        return self.con.execute(sql, *a)

    def executemany(self, sql, rows):
        self._took(sql)
        return self.con.executemany(sql, rows)

    def commit(self):
        if self.dirty:
            raise sqlite3.OperationalError("disk I/O error")
        return self.con.commit()

    def __getattr__(self, name):
        return getattr(self.con, name)


def test_a_disk_that_fills_up_before_the_writer_process_is_ready_loses_no_more_than_it_must(tmp_path, monkeypatch):
    """CI once failed here (the full-disk test below): the writer thread, writing while the writer
    process started, hit the full disk; at the handoff its commit raised again, which ended the
    thread's loop, and every row after it (the steps, the run's end and its step count) was lost.
    The failed rows are now dropped at once, the first failure is kept as writer_error, and the
    process writes the rest."""
    slow = tmp_path / "slow_child.py"
    slow.write_text(f"import runpy, sys, time\ntime.sleep(3)\nrunpy.run_path({str(trace_mod._CHILD)!r}, run_name='__main__')\n")
    monkeypatch.setattr(trace_mod, "_CHILD", slow)
    connect = trace_mod._connect
    monkeypatch.setattr(trace_mod, "_connect", lambda path: _FullDisk(connect(path)))  # (this process's writes only)
    w = TraceWriter(tmp_path / "t.sqlite")
    w.set_meta(status="running")
    meta, host = _rows(3, 20, 4)
    for step in (0, 1):
        w.add_stat_rows(step, meta, host, 12)
        w.commit()
    time.sleep(3.5)  # the process is ready now: it writes the rest
    w.add_stat_rows(2, meta, host, 12)
    w.commit()
    w.flush()
    assert w._child is not None  # (it took over)
    w.set_meta(status="finished", steps=3)
    w.close()
    r = TraceReader(tmp_path / "t.sqlite")
    m = r.meta()
    assert [s["step"] for s in r.stats()] == [2, 2, 2]
    assert m["status"] == "finished" and m["steps"] == 3
    assert m["writer_error"] == {"error": "OperationalError: disk I/O error", "step": 0}


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_a_run_folder_deleted_mid_run_is_written_again(tmp_path, monkeypatch, capfd, mode):
    # `rm -rf` of the run folder while the script trains: the writer still holds every row (its
    # file is open), and writes the trace again where it was, with the steps after the deletion
    import shutil
    monkeypatch.setenv(trace_mod.WRITER_ENV, mode)
    path = tmp_path / "run" / "trace.sqlite"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    w = ampdoctor.watch(model, trace=str(path))
    train(model, 2)
    w.session.writer.flush()
    shutil.rmtree(tmp_path / "run")
    train(model, 3)
    w.remove()
    assert path.exists()
    r = TraceReader(path)
    assert [s["step"] for s in r.steps()] == [0, 1, 2, 3, 4]
    assert r.meta()["status"] == "finished"
    assert {s["step"] for s in r.stats()} == {0, 1, 2, 3, 4}
    assert "was deleted while the run wrote it" in capfd.readouterr().err


FULL_DISK = """
import resource, sys, torch, ampdoctor
from torch import nn
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.SGD(m.parameters(), lr=0.01)
w = ampdoctor.watch(m, trace=sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))  # every file this process (and its writer) grows
for i in range(40):
    loss = m(torch.randn(4, 8)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
w.remove()
print("done")
"""


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "darwin", reason="RLIMIT_FSIZE as a stand-in for a full disk")
@pytest.mark.parametrize("mode", ["process", "thread"])
def test_a_trace_that_cannot_be_written_on_is_reported_incomplete(tmp_path, mode):
    # a disk that fills up mid-run (here: a file size limit, which fails the writes the same way): training
    # goes on, the steps written are kept, and the report says the trace stops short, and why where it can
    import subprocess

    from ampdoctor.report.model import build_report
    script = tmp_path / "full.py"
    script.write_text(FULL_DISK)
    path = tmp_path / "t.sqlite"
    env = dict(os.environ, **{trace_mod.WRITER_ENV: mode})
    p = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0 and "done" in p.stdout, p.stderr
    rep = build_report(path)
    held = len(TraceReader(path).steps())
    assert 0 < held < 40
    assert rep.diagnosis.steps_seen == held
    said = [line for line in rep.diagnosis.lines if line.startswith("The trace is incomplete")]
    assert len(said) == 1 and f"it holds {held} steps of the 40 the run took" in said[0], rep.diagnosis.lines
    assert "give --out (watch(trace=...)) a folder on another" in said[0]


def test_the_report_of_a_complete_trace_says_nothing_is_missing(tmp_path):
    from ampdoctor.report.model import build_report
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite"), every=10):
        train(model, 25)
    rep = build_report(tmp_path / "t.sqlite")
    assert rep.diagnosis.steps_seen == 25
    assert not any("incomplete" in line for line in rep.diagnosis.lines)


def _slow_inserts(monkeypatch, seconds, gate=None):
    real = trace_mod._insert_rows

    def slow(*a, **k):
        if gate is not None:
            gate.wait(30)
        time.sleep(seconds)
        return real(*a, **k)

    monkeypatch.setattr(trace_mod, "_insert_rows", slow)


def test_a_writer_that_falls_behind_holds_back_training_not_memory(tmp_path, monkeypatch):
    # rows come faster than the disk takes them: commit() waits at the step boundary once the rows waiting
    # in memory pass MAX_PENDING, so the queue stays short; nothing is dropped
    monkeypatch.setenv(trace_mod.WRITER_ENV, "thread")
    _slow_inserts(monkeypatch, 0.02)
    meta, host = _rows(100, 12 + 42, 1)  # 43 KB of rows a step
    monkeypatch.setattr(TraceWriter, "MAX_PENDING", 100_000, raising=False)
    w = TraceWriter(tmp_path / "t.sqlite")
    longest = 0
    for step in range(40):
        w.add_stat_rows(step, meta, host, 12)
        w.add_step((step, 1.0, None, None, step + 1, 1, 0.0))
        w.commit()
        longest = max(longest, w._q.qsize())
    w.close()
    assert longest <= 8, longest  # (unbounded, it reached about 120 items)
    assert w.waited > 0
    r = TraceReader(tmp_path / "t.sqlite")
    assert len(r.steps()) == 40 and len(r.stats()) == 40 * 100


def test_close_waits_for_a_slow_writer_while_it_makes_progress(tmp_path, monkeypatch):
    # 10 items at 0.3 s each: close(timeout=1) used to give up after 1 s with most rows not yet written
    monkeypatch.setenv(trace_mod.WRITER_ENV, "thread")
    _slow_inserts(monkeypatch, 0.3)
    meta, host = _rows(5, 12 + 42, 2)
    w = TraceWriter(tmp_path / "t.sqlite")
    for step in range(10):
        w.add_stat_rows(step, meta, host, 12)
    w.commit()
    w.close(timeout=1.0)
    assert not w._thread.is_alive()
    assert len(TraceReader(tmp_path / "t.sqlite").stats()) == 50


def test_close_gives_up_on_a_stuck_writer_and_says_so(tmp_path, monkeypatch, caplog):
    import threading
    monkeypatch.setenv(trace_mod.WRITER_ENV, "thread")
    gate = threading.Event()
    _slow_inserts(monkeypatch, 0.0, gate)
    meta, host = _rows(5, 12 + 42, 3)
    w = TraceWriter(tmp_path / "t.sqlite")
    w.add_stat_rows(0, meta, host, 12)
    w.commit()
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="ampdoctor.trace"):
        w.close(timeout=0.5)
    assert time.monotonic() - t0 < 5
    assert any("made no progress" in r.getMessage() and "not written" in r.getMessage() for r in caplog.records)
    gate.set()
    w._thread.join(10)


def test_a_run_that_waited_for_the_writer_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv(trace_mod.WRITER_ENV, "thread")
    _slow_inserts(monkeypatch, 0.05)
    monkeypatch.setattr(TraceWriter, "MAX_PENDING", 1, raising=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite")):
        train(model, 4)
    notes = [e["detail"] for e in TraceReader(tmp_path / "t.sqlite").events("note")]
    waited = [d for d in notes if "fell behind" in d.get("message", "")]
    assert len(waited) == 1 and waited[0]["waited_s"] > 0
