"""Edges of the command line: files in the way of a trace, bad option values, mistyped options,
notebooks, odd bisect folders, Ctrl-C during bisect, and advice that quotes steps after the break."""

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import bisect_until_trial
from report_helpers import synthetic_trace

from ampdoctor.cli import main

ROOT = Path(__file__).parent.parent


class _Ran(Exception):
    """Raised by the stand-ins of run_script/run_bisect: the command got past its checks."""


@pytest.fixture
def no_run(monkeypatch, tmp_path):
    """The CLI in this process, with the script never run (a check that should stop it did not)."""
    import ampdoctor.bisect.driver as driver
    import ampdoctor.runner as runner

    calls = []

    def ran(*args, **kwargs):
        calls.append(args)
        raise _Ran()

    monkeypatch.setattr(runner, "run_script", ran)
    monkeypatch.setattr(driver, "run_bisect", ran)
    monkeypatch.chdir(tmp_path)  # (a default run folder lands here)
    return calls


def _cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _script(tmp_path, name="train.py"):
    s = tmp_path / name
    s.write_text("raise SystemExit('the script must not run')\n")
    return s


def _foreign(kind, path):
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "garbage":
        path.write_bytes(bytes(range(256)) * 4)
    else:  # a valid SQLite database of someone else's
        import sqlite3
        con = sqlite3.connect(path)
        con.execute("CREATE TABLE results (a, b)")
        con.execute("INSERT INTO results VALUES (1, 2)")
        con.commit()
        con.close()
    return path.read_bytes()


@pytest.mark.parametrize("kind", ["garbage", "sqlite"])
def test_run_refuses_an_out_folder_whose_trace_is_not_ours(tmp_path, no_run, kind):
    before = _foreign(kind, tmp_path / "out" / "trace.sqlite")
    r = _cli("run", "--out", tmp_path / "out", _script(tmp_path))
    assert r.exit_code == 2, (r.output, r.exception)
    assert "is not an ampdoctor trace" in r.output and "pick another --out or remove it" in r.output, r.output
    assert not no_run and (tmp_path / "out" / "trace.sqlite").read_bytes() == before


def test_bisect_never_overwrites_a_trace_that_is_not_ours(tmp_path, no_run):
    from ampdoctor.bisect.driver import keep_baseline_trace

    out = tmp_path / "out"
    before = _foreign("sqlite", out / "trace.sqlite")
    r = _cli("bisect", "--out", out, _script(tmp_path))
    assert r.exit_code == 2 and "is not an ampdoctor trace" in r.output, (r.output, r.exception)
    assert "pick another --out or remove it" in r.output and not no_run
    # and the copy of the baseline's trace at the end refuses too (it used shutil.copy unchecked)
    base = out / "trials" / "00-baseline"
    base.mkdir(parents=True)
    synthetic_trace(base / "trace.sqlite", grad_exps=[(0, 4)], scales=[1024.0, 1024.0])
    with pytest.raises(ValueError, match="not an ampdoctor trace"):
        keep_baseline_trace(out, {"trial_details": [{"name": "baseline", "folder": str(base)}]})
    assert (out / "trace.sqlite").read_bytes() == before


@pytest.mark.parametrize("args,said", [
    (["--divergence", "-1"], "divergence=-1.0"), (["--divergence", "0"], "divergence=0.0"),
    (["--divergence", "nan"], "divergence=nan"),
    (["--timeout", "0"], "--timeout"), (["--timeout", "-5"], "--timeout"), (["--timeout", "nan"], "--timeout"),
])
def test_bisect_rejects_bad_divergence_and_timeout(tmp_path, no_run, args, said):
    r = _cli("bisect", *args, _script(tmp_path))
    assert r.exit_code == 2, (r.output, r.exception)
    assert said in r.output and "must be > 0" in r.output and not no_run, r.output


@pytest.mark.parametrize("args,said", [
    (["run", "--outdir", "x"], "No such option '--outdir'. Did you mean '--out'?"),
    (["run", "--max-step=3"], "No such option '--max-step'. Did you mean '--max-steps'?"),
    (["run", "--csv", "f.csv"], "No such option '--csv'"),
    (["bisect", "--jobz", "2"], "No such option '--jobz'"),
])
def test_a_mistyped_option_before_the_script_is_no_such_option(tmp_path, no_run, args, said):
    r = _cli(*args, _script(tmp_path))
    assert r.exit_code == 2, (r.output, r.exception)
    assert said in r.output and "script not found" not in r.output and not no_run, r.output


def test_options_after_the_script_still_go_to_the_script(tmp_path, no_run):
    s = _script(tmp_path)
    r = _cli("run", "--out", tmp_path / "o", s, "--outdir", "x")
    assert isinstance(r.exception, _Ran), r.output
    assert list(no_run[0][1]) == ["--outdir", "x"]


@pytest.mark.parametrize("command", ["run", "bisect"])
def test_a_notebook_is_a_usage_error(tmp_path, no_run, command):
    nb = tmp_path / "nb.ipynb"
    nb.write_text(json.dumps({"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    r = _cli(command, nb)
    assert r.exit_code == 2, (r.output, r.exception)
    assert "Jupyter notebook" in r.output and "jupyter nbconvert --to script" in r.output, r.output
    assert "ampdoctor.watch(model)" in r.output and not no_run


def test_report_of_a_bisect_json_that_is_not_a_result(tmp_path):
    """A bisect.json that is JSON but no bisect result (`[1]`) raised an AttributeError in the advice: the
    report leaves it out, with a note, and shows the trace."""
    synthetic_trace(tmp_path / "trace.sqlite", grad_exps=[(0, 4)], scales=[1024.0, 1024.0])
    (tmp_path / "bisect.json").write_text("[1]")
    r = _cli("report", tmp_path)
    assert r.exit_code == 0 and r.exception is None and "Diagnosis" in r.output, (r.output, r.exception)
    from ampdoctor.report import build_report

    rep = build_report(tmp_path)  # (the terminal wraps the note's path at its width: read it here)
    assert rep.bisect is None and any("bisect.json is not a bisect result" in n for n in rep.notes), rep.notes


def test_report_of_an_interrupted_bisect_folder_points_at_its_trials(tmp_path):
    base = tmp_path / "trials" / "00-baseline"
    base.mkdir(parents=True)
    synthetic_trace(base / "trace.sqlite", grad_exps=[(0, 4)], scales=[1024.0, 1024.0])
    r = _cli("report", tmp_path)
    assert r.exit_code == 1, (r.output, r.exception)
    assert "no baseline trace yet (interrupted?)" in r.output and str(base) in r.output, r.output


def test_divergence_advice_reads_only_the_losses_before_the_break(tmp_path):
    """The audit's overflow.py --scale 3000: the loss came back finite after the break (the scaler
    skipping NaN steps), and the advice quoted a loss from after it as a divergence."""
    from ampdoctor.report import build_report
    from ampdoctor.report.training import divergence_advice

    nan = math.nan
    after_only = [1.0, 0.9, 0.8, 0.1, 0.5, 0.6, nan, nan, nan, 1.5, nan, nan, nan]
    rep = build_report(synthetic_trace(tmp_path / "a.sqlite", grad_exps=[(0, 4)], scales=[1024.0] * 13,
                                       losses=after_only))
    assert rep.diagnosis.broke and rep.diagnosis.step == 6, rep.diagnosis
    assert divergence_advice(rep) == []
    before = [1.0, 0.1, 0.5, 2.0, nan, nan, nan, 0.05, 0.01]
    rep = build_report(synthetic_trace(tmp_path / "b.sqlite", grad_exps=[(0, 4)], scales=[1024.0] * 9, losses=before))
    assert rep.diagnosis.step == 4, rep.diagnosis
    (advice,) = divergence_advice(rep)
    assert "(step 1)" in advice and "(step 3) before training broke" in advice, advice


ENDLESS = """
import os, sys, torch
from torch import nn
torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
step = 0
while True:
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(4, 8)).float().pow(2).mean()
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    step += 1
    if step == 2:
        with open(sys.argv[1] + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(sys.argv[1] + ".tmp", sys.argv[1])
"""


def _group(pgid):
    """The live (not zombie) processes of process group ``pgid``."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            state, _ppid, pgrp = (d / "stat").read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(pgrp) == pgid and state not in ("Z", "X"):
            pids.append(int(d.name))
    return pids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("fork", [True, False], ids=["forked-trial", "fresh-interpreter"])
def test_ctrl_c_during_bisect_ends_the_trials_and_exits_130(tmp_path, fork):
    script, marker, out = tmp_path / "endless.py", tmp_path / "trial.pid", tmp_path / "b"
    script.write_text(ENDLESS)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for k in ("AMPDOCTOR_CONFIG", "AMPDOCTOR_TRACE_WRITER", "AMPDOCTOR_NO_FORK"):
        env.pop(k, None)
    if not fork:
        env["AMPDOCTOR_NO_FORK"] = "1"
    with bisect_until_trial(script, marker, out, tmp_path / "r.json", env) as (p, trial):
        assert os.getpgid(trial) == trial and len(_group(trial)) >= 2  # the trial and its trace writer
        os.killpg(p.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        t0 = time.monotonic()
        _, err = p.communicate(timeout=20)
        assert p.returncode == 130, err
        assert time.monotonic() - t0 < 10 and "interrupted" in err.splitlines()[-1], err
        deadline = time.monotonic() + 5
        while _group(trial) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _group(trial), "a trial process outlived bisect"
        res = json.loads((tmp_path / "r.json").read_text())
        assert res["verdict"] == "error" and "interrupted" in res["error"], res


# -- broken runs that end early: `run` and `bisect` agree ---------------------------------------

_OVERFLOW = """
import sys, torch
from torch import nn
torch.set_num_threads(1); torch.manual_seed(0)
mode, steps = sys.argv[1], int(sys.argv[2])
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 1))
with torch.no_grad(): model[2].weight.mul_(3000)   # its output passes fp16's max from step 24 on
opt = torch.optim.Adam(model.parameters(), 1e-3)
scaler = torch.amp.GradScaler("cpu")
for step in range(steps):
    x = torch.randn(8, 16) * (1 + step)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).float().pow(2).mean()
    if mode == "break" and not torch.isfinite(loss):
        print("loss", loss.item(), "at step", step, "- stopping"); break
    opt.zero_grad(); scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
"""


def _ampdoctor(*args, cwd):
    return subprocess.run([sys.executable, "-m", "ampdoctor", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("mode,steps", [("break", 60), ("plain", 26)])
def test_a_script_that_stops_on_its_nan_loss_or_just_after_it_broke(tmp_path, mode, steps):
    """`if not loss.isfinite(): break` before backward (the loss of step 24 never reaches backward),
    and a run whose last two losses are NaN (a streak shorter than the oracle's 3): `run` says the
    training broke at step 24, and bisect's baseline fails there too (it called both healthy)."""
    script = tmp_path / "overflow.py"
    script.write_text(_OVERFLOW)
    run = _ampdoctor("run", "--out", tmp_path / "run", script, "--", mode, steps, cwd=tmp_path)
    assert "Training broke at step 24: the loss became non-finite" in run.stdout, run.stdout + run.stderr
    bis = _ampdoctor("bisect", "--out", tmp_path / "bis", "--json", tmp_path / "b.json", script, "--", mode, steps,
                     cwd=tmp_path)
    res = json.loads((tmp_path / "b.json").read_text())
    assert res["verdict"] == "culprit" and res["culprits"] == ["2"], bis.stdout + bis.stderr
    assert res["failure"] == {"step": 24, "reason": "nonfinite_loss"}


def test_bisect_says_when_the_first_nonfinite_value_came_in_with_the_data(tmp_path):
    script = tmp_path / "data.py"
    script.write_text("""
import torch
from torch import nn
torch.set_num_threads(1); torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu")
for step in range(30):
    x = torch.randn(8, 4)
    if step >= 10:
        x = torch.sqrt(x)  # a data bug: NaN in any precision
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).float().pow(2).mean()
    opt.zero_grad(); scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
""")
    bis = _ampdoctor("bisect", "--out", tmp_path / "bis", "--json", tmp_path / "b.json", script, cwd=tmp_path)
    res = json.loads((tmp_path / "b.json").read_text())
    assert res["verdict"] == "not_precision", bis.stdout + bis.stderr
    assert res["first_nonfinite"] == {"layer": "0", "kind": "activation", "step": 10, "input_nonfinite": True}
    assert "first non-finite: the input of 0 at step 10" in bis.stdout


def test_a_script_that_catches_everything_still_stops_at_max_steps_in_the_trace(tmp_path):
    script = tmp_path / "bare.py"
    script.write_text("""
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(20):
    try:
        loss = model(torch.randn(4, 4)).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
    except:  # noqa: E722 - "retry on any error"
        pass
""")
    run = _ampdoctor("run", "--max-steps", 3, "--out", tmp_path / "run", script, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    from ampdoctor.trace import TraceReader
    with TraceReader(tmp_path / "run" / "trace.sqlite") as r:
        assert [s["step"] for s in r.steps()] == [0, 1, 2]
        assert r.meta()["status"] == "stopped"
        assert any("caught ampdoctor's stop" in e["detail"]["message"] for e in r.events("note"))


def test_weights_that_go_nonfinite_before_the_loss_are_the_break(tmp_path):
    """A pure .half() model whose weights overflow at step 32's update: its loss is NaN from step 33.
    The report says step 32, parameters, as bisect's oracle (which reads the weights) does."""
    script = tmp_path / "half.py"
    script.write_text("""
import torch
from torch import nn
torch.set_num_threads(1); torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1)).half()
with torch.no_grad():
    model[2].weight.mul_(50.0)
opt = torch.optim.SGD(model.parameters(), lr=1e-6)
for step in range(40):
    x = (torch.randn(16, 8) * (1 + step)).half()
    loss = model(x).float().pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
""")
    run = _ampdoctor("run", "--out", tmp_path / "run", script, cwd=tmp_path)
    from ampdoctor.trace import TraceReader
    with TraceReader(tmp_path / "run" / "trace.sqlite") as r:
        weight_nan = min(e["step"] for e in r.events("first_nonfinite") if e["detail"].get("kind") == "weight")
        loss_nan = min(s["step"] for s in r.steps() if s["loss"] is not None and not math.isfinite(s["loss"]))
    assert weight_nan < loss_nan
    assert f"Training broke at step {weight_nan}: parameters became non-finite" in run.stdout, run.stdout


def test_a_trial_that_ends_with_os_exit_0_is_judged_by_its_trace(tmp_path):
    script = tmp_path / "osexit.py"
    script.write_text("""
import os, torch
from torch import nn
torch.set_num_threads(1); torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(6):
    loss = model(torch.randn(4, 4)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    if step == 3:
        os._exit(0)  # (skips a hang at interpreter exit)
""")
    bis = _ampdoctor("bisect", "--out", tmp_path / "bis", "--json", tmp_path / "b.json", script, cwd=tmp_path)
    res = json.loads((tmp_path / "b.json").read_text())
    assert res["verdict"] == "healthy", bis.stdout + bis.stderr  # was error: "the trial process died (exit status 0)"
    assert bis.returncode == 0


def test_run_of_a_script_that_ends_with_os_exit_prints_the_report(tmp_path):
    """os._exit() skips every except and finally: the report is printed on the way out, and the
    process ends with the script's status. Forked DataLoader workers, which end with os._exit too,
    do not end the run."""
    script = tmp_path / "osexit.py"
    script.write_text("""
import os, torch
from torch import nn
torch.manual_seed(0)
class DS(torch.utils.data.Dataset):
    def __len__(self): return 16
    def __getitem__(self, i): return torch.randn(4)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for x in torch.utils.data.DataLoader(DS(), batch_size=4, num_workers=2, multiprocessing_context="fork"):
    loss = model(x).pow(2).mean(); opt.zero_grad(); loss.backward(); opt.step()
print("trained", flush=True)
os._exit(3)
""")
    run = _ampdoctor("run", "--out", tmp_path / "run", script, cwd=tmp_path)
    assert run.returncode == 3, run.stdout + run.stderr
    assert run.stdout.count("run folder:") == 1 and "Training did not break in the 4 steps seen" in run.stdout
    assert "ended the process with os._exit(3)" in run.stderr
    from ampdoctor.trace import TraceReader
    with TraceReader(tmp_path / "run" / "trace.sqlite") as r:
        assert len(r.steps()) == 4 and r.meta()["status"] == "exited"


def test_pass_after_is_capped_at_max_steps_with_a_note(tmp_path):
    """--max-steps below the baseline's failure step plus the margin: the trials pass at --max-steps, so
    `pass_after` says that step, not one no trial reached."""
    script = tmp_path / "overflow.py"
    script.write_text(_OVERFLOW)
    bis = _ampdoctor("bisect", "--max-steps", 27, "--no-drill", "--out", tmp_path / "bis", "--json", tmp_path / "b.json",
                     script, "--", "plain", 60, cwd=tmp_path)
    res = json.loads((tmp_path / "b.json").read_text())
    assert res["verdict"] == "culprit" and res["failure"]["step"] == 24, bis.stdout + bis.stderr
    assert res["pass_after"] == 27
    assert all(t["step"] <= 27 for t in res["trials"] if t["outcome"] == "pass")
    assert any("--max-steps 27 ends every trial before step" in n for n in res["notes"])


def test_bisect_trials_get_no_stdin_and_a_pipe_into_bisect_is_noted(tmp_path):
    """Trials inherited bisect's stdin: piped input went to the baseline and the control read EOF (a
    wrong verdict), and from a terminal a prompt blocked the baseline unseen. Now every trial reads an
    empty stdin, and bisect says so when something is piped into it."""
    script = tmp_path / "reads_stdin.py"
    script.write_text(textwrap.dedent("""
        import sys
        import torch
        from torch import nn
        print("stdin", repr(sys.stdin.read()), flush=True)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(4):
            model(torch.randn(2, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    """))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("AMPDOCTOR_CONFIG", None)
    out = tmp_path / "b"
    r = subprocess.run([sys.executable, "-m", "ampdoctor", "bisect", "--out", str(out), str(script)], input="60\n",
                       capture_output=True, text=True, env=env, timeout=300)
    assert "the trials run with no stdin" in r.stderr, r.stderr
    assert "verdict: healthy" in r.stdout, (r.stdout, r.stderr)
    assert "stdin ''" in (out / "trials" / "00-baseline" / "stdout.txt").read_text()
