"""The command line's answers to an audit: a run folder another live run writes into, `report --rank`
of a trace file and a folder of traces named by `watch(trace=...)`, read-only traces (and nothing left
beside a trace that was only read), scripts that train in child processes, scripts that do not compile
or are not Python, shell-quoted commands, and `raise SystemExit("message")`."""

import json
import os
import shlex
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from report_helpers import synthetic_trace

from ampdoctor.cli import main
from ampdoctor.trace import TraceReader

ROOT = Path(__file__).parent.parent


def amp(*args, cwd=None, timeout=120, env=None, prefix=()):
    env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
    env.pop("AMPDOCTOR_CONFIG", None)
    return subprocess.run([*prefix, sys.executable, "-m", "ampdoctor", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd or ROOT, env=env, timeout=timeout)


def cli(*args):
    """The CLI in this process (no torch import to wait for): exit_code and output (stdout and stderr)."""
    return CliRunner().invoke(main, [str(a) for a in args])


def _popen(*args):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("AMPDOCTOR_CONFIG", None)
    return subprocess.Popen([sys.executable, "-m", "ampdoctor", *map(str, args)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


# a script that trains STEPS steps; with a marker file argument, it writes it after its first step and
# then waits until the file is gone (at most 30 s)
_WAITS = """\
import sys, time, os
import torch
from torch import nn
import ampdoctor
torch.manual_seed(0)
m = nn.Linear(4, 4)
ampdoctor.watch(m)
opt = torch.optim.SGD(m.parameters(), lr=0.01)
marker = sys.argv[2] if len(sys.argv) > 2 else None
for i in range(int(sys.argv[1])):
    m(torch.randn(2, 4)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    if marker and i == 0:
        open(marker, "w").write(str(os.getpid()))
        deadline = time.time() + 30
        while os.path.exists(marker) and time.time() < deadline:
            time.sleep(0.05)
"""


def _wait_for(path: Path, proc: subprocess.Popen, wait: float = 60) -> None:
    deadline = time.monotonic() + wait
    while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert path.exists(), proc.communicate(timeout=30)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.communicate(timeout=30)


# -- 6: one run folder, two live runs ----------------------------------------------------------------
def test_a_second_run_or_bisect_into_a_live_runs_folder_is_refused(tmp_path):
    script, marker, out = tmp_path / "waits.py", tmp_path / "marker", tmp_path / "out"
    script.write_text(_WAITS)
    first = _popen("run", "--out", out, script, "4", marker)
    try:
        _wait_for(marker, first)
        second = cli("run", "--out", out, script, "2")
        assert second.exit_code == 2, (second.output, second.exception)
        assert f"(process {first.pid}) is still writing into {out}" in second.output, second.output
        assert "pick another --out, or wait until it ends" in second.output and "Traceback" not in second.output
        bis = cli("bisect", "--out", out, script, "2")
        assert bis.exit_code == 2 and f"(process {first.pid})" in bis.output, bis.output
        marker.unlink()
        stdout, stderr = first.communicate(timeout=60)
    finally:
        _kill(first)
    assert first.returncode == 0, stderr
    steps = [s["step"] for s in json.loads((out / "report.json").read_text())["timeline"]]
    assert steps == [0, 1, 2, 3]  # the first run's 4 steps, none of the second's mixed in
    assert not (out / ".ampdoctor.lock").exists()  # released at its end: the folder takes a new run
    from ampdoctor.cli import claim_out
    claim_out(out)()  # (taken and given back)


def test_a_run_into_a_live_bisects_folder_is_refused(tmp_path):
    # a bisect writes no trace into its folder before it ends: its lock alone says it is there
    script, marker, out = tmp_path / "waits.py", tmp_path / "marker", tmp_path / "out"
    script.write_text(_WAITS)
    bis = _popen("bisect", "--out", out, script, "--", "4", marker)
    try:
        _wait_for(marker, bis)
        assert not (out / "trace.sqlite").exists()
        p = cli("run", "--out", out, script, "2")
        assert p.exit_code == 2, (p.output, p.exception)
        assert f"another `ampdoctor bisect` (process {bis.pid}) is still writing into {out}" in p.output, p.output
    finally:
        trial = int(marker.read_text()) if marker.exists() else None
        _kill(bis)
        if trial:
            try:
                os.killpg(trial, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def test_in_process_bisect_takes_the_folders_lock_and_refuses_a_live_runs(tmp_path):
    import ampdoctor

    script, marker, out = tmp_path / "waits.py", tmp_path / "marker", tmp_path / "out"
    script.write_text(_WAITS)
    first = _popen("run", "--out", out, script, "4", marker)
    try:
        _wait_for(marker, first)
        with pytest.raises(RuntimeError, match=rf"another `ampdoctor run` \(process {first.pid}\) is still writing "
                                               rf"into {out}; pass another out=, or wait until it ends"):
            ampdoctor.bisect(lambda: None, out=out)
        marker.unlink()
        first.communicate(timeout=60)
    finally:
        _kill(first)
    assert first.returncode == 0
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file; pass a folder"):
        ampdoctor.bisect(lambda: None, out=tmp_path / "file")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "trace.sqlite").write_text("my notes")
    with pytest.raises(ValueError, match="is not an ampdoctor trace .*pass another out="):
        ampdoctor.bisect(lambda: None, out=tmp_path / "foreign")
    assert (tmp_path / "foreign" / "trace.sqlite").read_text() == "my notes"


def test_a_run_into_a_folder_an_in_process_bisect_holds_is_refused(tmp_path):
    import ampdoctor

    script, out = tmp_path / "waits.py", tmp_path / "out"
    script.write_text(_WAITS)
    seen = []

    def train():  # each trial asks the CLI for a run into the bisect's folder
        if not seen:
            seen.append(cli("run", "--out", out, script, "1"))
        m = torch.nn.Linear(4, 4)
        ampdoctor.watch(m)
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        for _ in range(3):
            m(torch.randn(2, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    res = ampdoctor.bisect(train, out=out, drill=False)
    assert res["verdict"] == "healthy", res["trial_details"]
    assert seen[0].exit_code == 2, seen[0].output
    assert f"another `ampdoctor bisect` (process {os.getpid()}) is still writing into {out}" in seen[0].output
    assert not (out / ".ampdoctor.lock").exists()  # given back at its end


# -- 7: --rank of a trace file; traces named by watch(trace=...) -------------------------------------
def _named_run(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    synthetic_trace(folder / "run.sqlite", grad_exps=[(0, 8)], scales=[None] * 3)
    synthetic_trace(folder / "run.rank1.sqlite", grad_exps=[(0, 8)], scales=[None] * 5)


def _steps(r, js: Path) -> tuple[str, int]:
    assert r.exit_code == 0, (r.output, r.exception)
    d = json.loads(js.read_text())
    return Path(d["trace"]).name, len(d["timeline"])


def test_report_rank_of_a_trace_file(tmp_path):
    # `report FILE --rank N` showed FILE whatever N was
    synthetic_trace(tmp_path / "trace.sqlite", grad_exps=[(0, 8)], scales=[None] * 3)
    synthetic_trace(tmp_path / "trace.rank1.sqlite", grad_exps=[(0, 8)], scales=[None] * 5)
    js = tmp_path / "r.json"
    assert _steps(cli("report", tmp_path / "trace.sqlite", "--rank", "1", "--json", js), js) == ("trace.rank1.sqlite", 5)
    assert _steps(cli("report", tmp_path / "trace.sqlite", "--json", js), js) == ("trace.sqlite", 3)


def test_report_rank_of_a_trace_file_and_of_a_folder_of_named_traces(tmp_path):
    run = tmp_path / "named"
    _named_run(run)
    js = tmp_path / "r.json"
    assert _steps(cli("report", run, "--json", js), js) == ("run.sqlite", 3)
    assert _steps(cli("report", run, "--rank", "1", "--json", js), js) == ("run.rank1.sqlite", 5)
    assert _steps(cli("report", run / "run.sqlite", "--rank", "1", "--json", js), js) == ("run.rank1.sqlite", 5)
    assert _steps(cli("report", run / "run.rank1.sqlite", "--rank", "0", "--json", js), js) == ("run.sqlite", 3)
    assert _steps(cli("report", run / "run.rank1.sqlite", "--json", js), js) == ("run.rank1.sqlite", 5)  # the file given
    r = cli("report", run / "run.sqlite", "--rank", "2")
    assert r.exit_code == 2 and "no trace of rank 2 beside" in r.output and "run.rank1.sqlite" in r.output, r.output
    assert sorted(os.listdir(run)) == ["run.rank1.sqlite", "run.sqlite"]  # nothing left beside them


def test_report_of_a_folder_finds_only_ampdoctor_traces(tmp_path):
    folder = tmp_path / "other"
    folder.mkdir()
    con = sqlite3.connect(folder / "results.sqlite")  # someone else's database
    con.execute("CREATE TABLE results (a, b)")
    con.commit()
    con.close()
    before = (folder / "results.sqlite").read_bytes()
    r = cli("report", folder)
    assert r.exit_code == 1 and "no ampdoctor trace (*.sqlite) in" in r.output, r.output
    assert (folder / "results.sqlite").read_bytes() == before and os.listdir(folder) == ["results.sqlite"]
    synthetic_trace(folder / "a.sqlite", grad_exps=[(0, 8)], scales=[None] * 2)  # ours, beside it
    js = tmp_path / "r.json"
    assert _steps(cli("report", folder, "--json", js), js) == ("a.sqlite", 2)
    synthetic_trace(folder / "b.sqlite", grad_exps=[(0, 8)], scales=[None] * 2)  # two runs: which one?
    r = cli("report", folder)
    assert r.exit_code == 1 and "holds the traces of 2 runs (a.sqlite, b.sqlite)" in r.output, r.output


# -- 8: read-only traces, and nothing left beside a trace that was only read --------------------------
def _reader_prefix() -> tuple[str, ...]:
    """Run as a user who cannot write what root made read-only (root can write anything)."""
    if os.geteuid() != 0:
        return ()
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: no user for whom a file is read-only")
    return (setpriv, "--reuid=65534", "--regid=65534", "--clear-groups")


@pytest.mark.parametrize("folder_writable", [True, False])
def test_report_of_a_read_only_trace(tmp_path, folder_writable):
    prefix = _reader_prefix()
    # (a folder the other user can reach: tmp_path's parents are private to root)
    folder = Path(tempfile.mkdtemp(dir="/tmp" if prefix else tmp_path))
    try:
        synthetic_trace(folder / "trace.sqlite", grad_exps=[(0, 8)], scales=[None] * 3)
        assert sorted(os.listdir(folder)) == ["trace.sqlite"]
        (folder / "trace.sqlite").chmod(0o444)
        folder.chmod(0o777 if folder_writable else 0o555)
        js = Path(tempfile.mkdtemp(dir="/tmp" if prefix else tmp_path))
        js.chmod(0o777)
        p = amp("report", folder, "--json", js / "r.json", prefix=prefix)
        assert p.returncode == 0, p.stderr
        assert "readonly" not in p.stderr and len(json.loads((js / "r.json").read_text())["timeline"]) == 3
        assert sorted(os.listdir(folder)) == ["trace.sqlite"]  # no -wal/-shm left beside it
        shutil.rmtree(js)
    finally:
        folder.chmod(0o755)
        shutil.rmtree(folder)


def test_a_run_into_a_folder_with_an_old_trace_leaves_no_side_files_of_reading_it(tmp_path):
    # the check of an existing trace before a run (is it ours?) opened it read-only and left -wal/-shm
    from ampdoctor.trace import trace_problem

    synthetic_trace(tmp_path / "trace.sqlite", grad_exps=[(0, 8)], scales=[None] * 2)
    assert trace_problem(tmp_path / "trace.sqlite") is None
    assert sorted(os.listdir(tmp_path)) == ["trace.sqlite"]
    from ampdoctor.trace import trace_meta
    assert trace_meta(tmp_path / "none.sqlite") is None and not (tmp_path / "none.sqlite").exists()  # (not made)


# -- 9: training in child processes ------------------------------------------------------------------
_SPAWNS = """\
import torch
import torch.multiprocessing as mp
from torch import nn
import ampdoctor


def worker(rank):
    m = nn.Linear(4, 4)
    ampdoctor.watch(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    for _ in range(2):
        m(torch.randn(2, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


if __name__ == "__main__":
    mp.spawn(worker, nprocs=1)
"""


def test_a_script_that_trains_in_mp_spawn_children_is_told_so(tmp_path):
    script = tmp_path / "spawns.py"
    script.write_text(_SPAWNS)
    p = amp("run", "--out", tmp_path / "out", script)
    assert p.returncode == 3, p.stderr
    assert "started 1 child process (torch.multiprocessing.spawn(worker)), which ampdoctor does not follow" in p.stderr
    assert "ampdoctor run --nproc-per-node N" in p.stderr and "no optimizer.step() or GradScaler" not in p.stderr
    # the child's watch() records on its own (a temporary trace it names), not into the run's trace
    assert "was started by the script that `ampdoctor run`/`bisect` runs" in p.stderr, p.stderr
    assert "ampdoctor: recording to " in p.stderr, p.stderr
    run_trace = tmp_path / "out" / "trace.sqlite"
    assert not run_trace.exists() or TraceReader(run_trace).steps() == []


def test_child_processes_counted_are_the_scripts_own_not_dataloader_workers(tmp_path):
    from ampdoctor.config import RunConfig
    from ampdoctor.runner import run_script

    script = tmp_path / "children.py"
    script.write_text(
        "import multiprocessing as mp\nimport torch\n"
        "def f():\n    pass\n"
        "if __name__ == '__main__':\n"
        "    ctx = mp.get_context('fork')\n"
        "    p = ctx.Process(target=f)\n    p.start()\n    p.join()\n"
        "    dl = torch.utils.data.DataLoader(list(range(4)), num_workers=1, multiprocessing_context='fork')\n"
        "    print(sum(int(b.sum()) for b in dl))\n")
    r = run_script(script, [], RunConfig(trace=str(tmp_path / "t.sqlite")))
    assert r.status == "finished", r.traceback
    assert r.children == ["multiprocessing.Process(f)"]
    import multiprocessing.process as mpp
    assert mpp.BaseProcess.start.__qualname__ == "BaseProcess.start"  # undone after the run


# -- 12: scripts that do not compile, files that are not Python --------------------------------------
@pytest.mark.parametrize("command", ["run", "bisect"])
def test_a_script_with_a_syntax_error_is_refused_before_it_runs(tmp_path, command):
    script = tmp_path / "syn.py"
    script.write_text("import torch\nx = (1,\nprint('hi')\n")
    p = amp(command, "--out", tmp_path / "out", script)
    assert p.returncode == 2, p.stderr
    assert f"{script}:2: SyntaxError: '(' was never closed" in p.stderr, p.stderr
    assert "x = (1," in p.stderr and "Traceback" not in p.stderr and "watch()" not in p.stdout + p.stderr
    assert not (tmp_path / "out").exists()  # nothing ran


def test_a_file_that_is_not_python_is_refused_and_one_without_suffix_runs(tmp_path):
    txt = tmp_path / "notes.txt"
    txt.write_text("print('the txt ran')\n")
    p = amp("run", "--out", tmp_path / "out", txt)
    assert p.returncode == 2, p.stderr
    assert f"{txt} is not a Python script (.txt file)" in p.stderr and "the txt ran" not in p.stdout
    plain = tmp_path / "train"  # (`#!/usr/bin/env python` scripts have no suffix)
    plain.write_text("#!/usr/bin/env python\nprint('the script ran')\n")
    p = amp("run", "--out", tmp_path / "out2", plain)
    assert p.returncode == 3 and "the script ran" in p.stdout, p.stderr


# -- 13: quoted commands, SystemExit's message --------------------------------------------------------
def test_printed_report_command_is_shell_quoted_and_system_exit_message_shown(tmp_path):
    script = tmp_path / "exits.py"
    script.write_text("import ampdoctor\nraise SystemExit('bad config: lr must be > 0')\n")
    out = tmp_path / "my runs" / "a b"
    p = amp("run", "--out", out, script)
    assert p.returncode == 1, p.stderr
    said = ("bad config: lr must be > 0\n" in p.stderr, f"re-render: ampdoctor report {shlex.quote(str(out))})" in p.stdout)
    assert said == (True, True), (p.stdout, p.stderr)
    assert cli(*shlex.split(p.stdout.rsplit("re-render: ampdoctor ", 1)[1].rstrip().rstrip(")"))).exit_code == 0


# -- output paths that cannot be written: usage errors before anything runs --------------------------
@pytest.mark.parametrize("args, message", [
    (["run", "--out", "{f}/sub", "{s}"], "cannot make the run folder {f}/sub: {f} is a file, not a folder: pick another --out"),
    (["bisect", "--out", "{f}/sub", "{s}"], "cannot make the run folder {f}/sub: {f} is a file, not a folder"),
    (["run", "--out", "{t}/o", "--json", "{f}/x.json", "{s}"], "--json {f}/x.json: {f} is a file, not a folder"),
    (["run", "--out", "{t}/o", "--html", "{f}/x/y.html", "{s}"], "--html {f}/x/y.html: {f} is a file, not a folder"),
    (["bisect", "--out", "{t}/o", "--json", "{f}/x.json", "{s}"], "--json {f}/x.json: {f} is a file, not a folder"),
])
def test_output_paths_that_cannot_be_made_are_usage_errors(tmp_path, args, message):
    # `--out afile/sub` raised NotADirectoryError out of the folder's lock; `--json afile/x.json` ran the
    # whole script, then said it could not write the file, and exited 0
    script = tmp_path / "s.py"
    script.write_text("raise SystemExit('the script ran')\n")
    (tmp_path / "afile").write_text("x")
    fill = {"f": str(tmp_path / "afile"), "s": str(script), "t": str(tmp_path)}
    r = cli(*[a.format(**fill) for a in args])
    assert r.exit_code == 2, r.output
    assert message.format(**fill) in r.output, r.output
    assert "the script ran" not in r.output and "Traceback" not in r.output
    assert not (tmp_path / "o").exists()


def test_report_outputs_that_cannot_be_written_are_usage_errors(tmp_path):
    synthetic_trace(tmp_path / "t.sqlite", grad_exps=[(0, 8)], scales=[None] * 2)
    (tmp_path / "afile").write_text("x")
    r = cli("report", "--csv", tmp_path / "afile" / "x.csv", tmp_path / "t.sqlite")
    assert r.exit_code == 2 and f"--csv {tmp_path / 'afile' / 'x.csv'}: {tmp_path / 'afile'} is a file" in r.output
    r = cli("report", "--json", tmp_path, tmp_path / "t.sqlite")
    assert r.exit_code == 2 and "is a directory" in r.output, r.output
