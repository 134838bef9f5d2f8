"""`ampdoctor run` and `ampdoctor report` end to end, in subprocesses like a user would."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ampdoctor.trace import TraceReader

HERE = Path(__file__).parent
ROOT = HERE.parent
SCRIPTS = HERE / "scripts"


def amp(*args, cwd=None, timeout=120):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("AMPDOCTOR_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "ampdoctor", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd or ROOT, env=env, timeout=timeout)


def test_run_script_without_watch_names_producer_and_step(tmp_path):
    out = tmp_path / "run"
    p = amp("run", "--out", out, SCRIPTS / "no_watch_overflow.py", "--", "--steps", "12")
    assert p.returncode == 0, p.stderr
    report = json.loads((out / "report.json").read_text())
    fn = report["diagnosis"]["first_nonfinite"]
    assert fn["layer"] == "hidden" and fn["kind"] == "activation"
    assert "hidden" in p.stdout and "First non-finite value: step" in p.stdout
    assert report["diagnosis"]["broke"] is True
    assert fn["step"] == 6 and report["diagnosis"]["first_loss_nonfinite"] == 8  # tanh hides the Inf for two steps
    assert (out / "trace.sqlite").exists()


def test_script_args_after_double_dash(tmp_path):
    out = tmp_path / "run"
    p = amp("run", "--out", out, SCRIPTS / "no_watch_overflow.py", "--", "--steps", "3")
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("step ") >= 3
    assert len(TraceReader(out / "trace.sqlite").steps()) == 3
    r = amp("-v", "report", out)  # README: -v logs what it does (report logged nothing)
    assert r.returncode == 0 and f"reading {out}" in r.stderr and "3 steps in the timeline" in r.stderr, r.stderr
    # one prefix per line: "ampdoctor: reading ...", not "ampdoctor.report: ampdoctor: reading ..."
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines and all(ln.startswith("ampdoctor") and ln.count("ampdoctor") == 1 for ln in lines
                         if "reading" in ln or "timeline" in ln), r.stderr


def test_max_steps_stops_cleanly(tmp_path):
    out = tmp_path / "run"
    p = amp("run", "--out", out, "--max-steps", "4", SCRIPTS / "no_watch_overflow.py")
    assert p.returncode == 0, p.stderr
    assert len(TraceReader(out / "trace.sqlite").steps()) == 4
    assert "stopped the script cleanly" in p.stderr


THREAD_TRAIN = """
import threading, torch
def work():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    for i in range(50):
        loss = m(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
    print("worker done")
t = threading.Thread(target=work)
t.start()
t.join()
print("main done")
"""


def test_max_steps_reached_in_a_thread_stops_the_script_quietly(tmp_path):
    # the stop is raised in the thread that trains: no "Exception in thread" traceback of ours, and the
    # main thread stops after its join() as a script training in the main thread would
    script = tmp_path / "thread_train.py"
    script.write_text(THREAD_TRAIN)
    out = tmp_path / "run"
    p = amp("run", "--out", out, "--max-steps", "3", script)
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr and "StopRun" not in p.stderr, p.stderr
    assert "worker done" not in p.stdout and "main done" not in p.stdout
    assert "stopped the script cleanly (max_steps) after 3 step(s)" in p.stderr
    assert len(TraceReader(out / "trace.sqlite").steps()) == 3
    assert json.loads((out / "report.json").read_text())["meta"]["stop_reason"] == "max_steps"


def test_run_script_puts_back_the_thread_excepthook_and_sigint_handler(tmp_path):
    import signal
    import threading

    from ampdoctor.config import RunConfig
    from ampdoctor.runner import run_script
    script = tmp_path / "thread_train.py"
    script.write_text(THREAD_TRAIN)
    hook, handler = threading.excepthook, signal.getsignal(signal.SIGINT)
    res = run_script(script, [], RunConfig(trace=str(tmp_path / "t.sqlite"), max_steps=2))
    assert res.status == "stopped" and res.stop_reason == "max_steps"
    assert threading.excepthook is hook and signal.getsignal(signal.SIGINT) is handler


def test_missing_script_is_a_usage_error(tmp_path):
    p = amp("run", tmp_path / "nope.py")
    assert p.returncode == 2
    assert "script not found" in p.stderr and "Traceback" not in p.stderr
    p = amp("run", tmp_path)
    assert p.returncode == 2 and "is a directory, not a script" in p.stderr and "Traceback" not in p.stderr


def test_script_that_raises_keeps_trace(tmp_path):
    out = tmp_path / "run"
    p = amp("run", "--out", out, SCRIPTS / "raises.py")
    assert p.returncode == 1
    assert "boom in the user's script" in p.stderr
    assert "ampdoctor/runner.py" not in p.stderr  # the user's traceback, not ours
    assert len(TraceReader(out / "trace.sqlite").steps()) == 3
    assert TraceReader(out / "trace.sqlite").meta()["status"] == "crashed"
    assert "failed after 3 completed step(s)" in p.stderr


def test_script_that_raises_in_its_first_step_says_no_step_completed(tmp_path):
    # the forward raises after a first layer ran (an op the backend does not support): the partial
    # step is in the trace, but no step completed (it said "failed after 1 step(s)")
    script = tmp_path / "first_step.py"
    script.write_text(
        "import torch\nfrom torch import nn\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.a = nn.Linear(4, 4)\n"
        "    def forward(self, x):\n        h = self.a(x)\n        raise RuntimeError('unsupported op')\n"
        "model = Net()\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "model(torch.randn(2, 4)).sum().backward()\nopt.step()\n")
    out = tmp_path / "run"
    p = amp("run", "--out", out, script)
    assert p.returncode == 1 and "unsupported op" in p.stderr
    assert "failed after 0 completed step(s)" in p.stderr, p.stderr


def test_script_that_never_trains(tmp_path):
    p = amp("run", "--out", tmp_path / "run", SCRIPTS / "no_training.py")
    assert p.returncode == 3
    assert "never trained" in p.stderr
    # the report says so too (it said "Training did not break in the 1 step seen"), also when re-rendered
    for text in (p.stdout, amp("report", tmp_path / "run").stdout):
        text = " ".join(text.split())  # (the terminal report wraps at the terminal's width)
        assert "Nothing trained in the 1 step seen: no backward pass, no optimizer.step()" in text, text
        assert "Training did not break" not in text
    # the automatic watch begins inside the model's first call, past its pre-hooks: that call's output is
    # recorded, and not taken for a call begun before a step boundary (a note said "returns after the
    # optimizer step", and the output was lost)
    assert "returns after the optimizer step" not in " ".join(p.stdout.split())
    rows = json.loads((tmp_path / "run" / "report.json").read_text())["layers"]
    assert any(r["layer"] == "(root)" and r["kind"] == "activation" for r in rows), rows


def test_scripts_help_is_not_a_run_that_never_trained(tmp_path):
    p = amp("run", "--out", tmp_path / "run", SCRIPTS / "no_watch_overflow.py", "-h")
    assert p.returncode == 0, p.stderr  # was 3, with "never trained" and an empty report
    assert "usage:" in p.stdout and "--steps" in p.stdout
    assert "printed its help" in p.stderr and "never trained" not in p.stderr and "Diagnosis" not in p.stdout


def test_scripts_help_under_bisect_is_shown_not_an_error(tmp_path):
    p = amp("bisect", "--out", tmp_path / "b", SCRIPTS / "no_watch_overflow.py", "-h")
    assert p.returncode == 0, p.stderr  # was 1: verdict error, "never trained", and the help unseen in a trial's log
    assert "usage:" in p.stdout and "--steps" in p.stdout
    assert "printed its help (above) and trained nothing" in p.stderr and "verdict" not in p.stdout


def test_bisect_names_a_second_models_root_as_its_whole_model():
    from ampdoctor.bisect.cli import _shown

    assert [_shown(n) for n in ("", "D:", "D:net.0", "net.0")] == \
        ["(whole model)", "D: (whole model)", "D:net.0", "net.0"]


def test_ampdoctor_options_after_the_script_name_get_a_hint(tmp_path):
    out = tmp_path / "run"
    p = amp("run", SCRIPTS / "no_watch_overflow.py", "--out", out, "--max-steps=3", cwd=tmp_path)
    assert p.returncode == 2 and "unrecognized arguments" in p.stderr, p.stderr  # the script's argparse
    assert "`--out`, `--max-steps` came after the script's name, so the script got them" in p.stderr, p.stderr
    assert "ampdoctor run --out ... script.py ARGS" in p.stderr
    p = amp("bisect", SCRIPTS / "no_watch_overflow.py", "--no-drill", cwd=tmp_path, timeout=300)
    assert p.returncode == 1 and "`--no-drill` came after the script's name" in p.stdout, p.stdout + p.stderr
    # the script's own options of other names: no hint
    p = amp("run", "--out", out, SCRIPTS / "no_watch_overflow.py", "--bogus", cwd=tmp_path)
    assert p.returncode == 2 and "came after the script's name" not in p.stderr


def test_the_scripts_own_logging_setup_works_under_run(tmp_path):
    """We called logging.basicConfig on the root logger, so the script's own was a no-op: its INFO lines
    vanished (and Lightning's printed twice)."""
    script = tmp_path / "logs.py"
    script.write_text("import logging\n"
                      "logging.basicConfig(level=logging.INFO, format='SCRIPT %(name)s %(message)s')\n"
                      "logging.getLogger('mylib').info('hello from the script')\n"
                      "logging.getLogger('mylib').warning('a warning')\n")
    p = amp("run", "--out", tmp_path / "run", script)
    assert p.returncode == 3, p.stderr  # never trained
    assert p.stderr.count("SCRIPT mylib hello from the script") == 1, p.stderr
    assert p.stderr.count("a warning") == 1, p.stderr
    assert "never trained" in p.stderr


def test_sigkill_leaves_readable_trace(tmp_path):
    out = tmp_path / "run"
    p = amp("run", "--out", out, SCRIPTS / "killed.py", "--", "--kill-at", "10")
    assert p.returncode == -9 or p.returncode == 137
    r = amp("report", out)
    assert r.returncode == 0, r.stderr
    steps = [s["step"] for s in TraceReader(out / "trace.sqlite").steps()]
    # every step whose rows the background writer committed before the kill: a contiguous prefix; the
    # writer lags the training loop by milliseconds (a step or two on a loaded machine)
    assert steps == list(range(len(steps))) and 7 <= len(steps) <= 10, steps
    assert "did not finish" in r.stdout


def test_report_json_and_bad_path(tmp_path):
    out = tmp_path / "run"
    amp("run", "--out", out, "--max-steps", "2", SCRIPTS / "no_watch_overflow.py")
    j = tmp_path / "r.json"
    r = amp("report", out, "--json", j, "--sort", "worst", "--top", "2")
    assert r.returncode == 0, r.stderr
    data = json.loads(j.read_text())
    assert {row["kind"] for row in data["layers"]} >= {"activation", "gradient"}
    bad = amp("report", tmp_path / "missing")
    assert bad.returncode != 0 and "does not exist" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3fn"])
def test_run_format_option(tmp_path, fmt):
    out = tmp_path / "run"
    p = amp("run", "--out", out, "--format", fmt, "--max-steps", "2", SCRIPTS / "no_watch_overflow.py")
    assert p.returncode == 0, p.stderr
    assert TraceReader(out / "trace.sqlite").meta()["format"] == fmt


BF16_SCRIPT = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-6)
for step in range(3):
    x = torch.randn(16, 8) * 1e4
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


def test_run_measures_a_bf16_script_against_bf16(tmp_path):
    """No --format: a bf16 autocast script is measured against bf16 (its activations beyond 65504 are
    not fp16 overflow here), the report does not ask for a rerun with --format bf16, and --format fp16
    still gives the fp16 readiness check."""
    script = tmp_path / "bf16_train.py"
    script.write_text(BF16_SCRIPT)
    p = amp("run", "--out", tmp_path / "auto", script)
    assert p.returncode == 0, p.stderr
    meta = TraceReader(tmp_path / "auto" / "trace.sqlite").meta()
    assert meta["format"] == "bf16" and "autocast to bfloat16" in meta["format_detected"]
    flat = lambda text: "".join(text.split())  # noqa: E731  (the terminal report wraps its lines)
    assert "--formatbf16" not in flat(p.stdout)
    assert "(therun's:autocasttobfloat16)" in flat(p.stdout)  # the report's header says where bf16 came from
    q = amp("run", "--out", tmp_path / "fp16", "--format", "fp16", script)
    assert q.returncode == 0, q.stderr
    assert TraceReader(tmp_path / "fp16" / "trace.sqlite").meta()["format"] == "fp16"
    assert "rerunwith--formatbf16" in flat(q.stdout)
    over = [r for r in TraceReader(tmp_path / "fp16" / "trace.sqlite").stats(kind="activation") if r["overflow"]]
    assert over and not [r for r in TraceReader(tmp_path / "auto" / "trace.sqlite").stats(kind="activation")
                         if r["overflow"]]


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda),
                                    pytest.param("cuda-gloo", marks=pytest.mark.cuda)])
def test_run_under_torchrun_one_trace_per_rank(tmp_path, device):
    """``cuda``: one GPU per rank over NCCL (needs 2 GPUs); ``cuda-gloo``: both ranks on the GPUs there
    are, over gloo (NCCL refuses two ranks on one GPU)."""
    if device == "cuda":
        import torch
        if torch.cuda.device_count() < 2:
            pytest.skip("needs 2 GPUs (DDP with NCCL, one GPU per rank)")
    out = tmp_path / "ddp"
    env_steps = dict(os.environ, STEPS="12", DDP_DEVICE=device.split("-")[0])
    if device == "cuda-gloo":
        env_steps["DDP_BACKEND"] = "gloo"
    p = subprocess.run([sys.executable, "-m", "ampdoctor", "run", "--out", str(out), "--nproc-per-node", "2",
                        str(SCRIPTS / "ddp_overflow.py")], capture_output=True, text=True, cwd=ROOT, env=env_steps,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    assert (out / "trace.sqlite").exists() and (out / "trace.rank1.sqlite").exists()
    report = json.loads((out / "report.json").read_text())
    assert report["diagnosis"]["first_nonfinite"]["layer"] == "2"
    assert any(n.startswith("rank 1 (trace.rank1.sqlite): Training broke") for n in report["notes"])
    # the fix names a module of the model inside DDP: say so (keep_fp32(model[2]) fails on the wrapper)
    fix = [a for a in report["advice"] if "keep_fp32(" in a]
    assert fix and "inside DistributedDataParallel" in fix[0], report["advice"]
    assert "inside DistributedDataParallel" in (out / "report.html").read_text()
    r1 = amp("report", out, "--rank", "1")
    assert r1.returncode == 0 and "trace.rank1.sqlite" in r1.stdout


def test_report_rank_is_the_rank_not_the_nth_file_and_top_must_be_positive(tmp_path):
    out = tmp_path / "run"
    amp("run", "--out", out, "--max-steps", "2", SCRIPTS / "no_watch_overflow.py")
    # a torchrun folder where rank 1 left no trace: rank 2 is the second file, not rank 1's
    (out / "trace.sqlite").rename(out / "trace.rank2.sqlite")
    (out / "trace.rank0.sqlite").write_bytes((out / "trace.rank2.sqlite").read_bytes())
    r = amp("report", out, "--rank", "1")
    assert r.returncode == 2 and "no trace of rank 1" in r.stderr and "0, 2" in r.stderr and "Traceback" not in r.stderr
    r = amp("report", out, "--rank", "2")
    assert r.returncode == 0 and "trace.rank2.sqlite" in r.stdout, r.stderr
    for top in ("-1", "0"):  # rows[:-1] silently dropped the last row of each table
        r = amp("report", out, "--top", top)
        assert r.returncode == 2 and "--top" in r.stderr


def test_run_with_relative_out_of_a_script_that_changes_directory(tmp_path):
    """A script that os.chdir()s: the report was read from the relative --out under the script's new
    directory (FileNotFoundError traceback, no report) and --json went there too."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    script = tmp_path / "chdir_train.py"
    script.write_text(
        "import os, torch\n"
        f"os.chdir({str(elsewhere)!r})\n"
        "model = torch.nn.Linear(4, 1)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for _ in range(3):\n"
        "    loss = model(torch.randn(8, 4)).pow(2).mean()\n"
        "    opt.zero_grad(); loss.backward(); opt.step()\n")
    p = amp("run", "--out", "run", "--json", "r.json", script, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "run" / "report.json").exists() and (tmp_path / "r.json").exists()
    assert not (elsewhere / "r.json").exists()


@pytest.mark.parametrize("ending, code, said", [
    ("raise KeyboardInterrupt", 130, "interrupted (KeyboardInterrupt)"),
    ("sys.exit(4)", 4, "exited with status 4"),
])
def test_interrupted_or_failing_exit_is_said_in_the_report(tmp_path, ending, code, said):
    """Ctrl-C (or sys.exit(non-zero)) mid-training: the trace says status interrupted/exited, but the
    report's diagnosis said only 'Training did not break in the 3 steps seen', as for a finished run."""
    script = tmp_path / "train.py"
    script.write_text((SCRIPTS / "raises.py").read_text().replace(
        "raise RuntimeError(\"boom in the user's script\")", f"import sys\n{ending}"))
    out = tmp_path / "run"
    p = amp("run", "--out", out, script)
    assert p.returncode == code, p.stderr
    assert said in p.stdout
    r = amp("report", out)
    assert r.returncode == 0 and said in r.stdout, r.stdout


def test_syntax_error_in_the_script_shows_no_frames_of_ours(tmp_path):
    from ampdoctor.config import RunConfig
    from ampdoctor.runner import run_script

    script = tmp_path / "bad.py"
    script.write_text("import torch\ndef f(:\n    pass\n")
    r = run_script(script, [], RunConfig(trace=str(tmp_path / "t.sqlite")))
    assert r.status == "crashed" and r.error.startswith("SyntaxError")
    assert "bad.py\", line 2" in r.traceback and "def f(:" in r.traceback
    assert "runner.py" not in r.traceback and "runpy" not in r.traceback


def test_report_outputs_into_new_folders_and_bad_kinds_before_the_script_runs(tmp_path):
    out = tmp_path / "run"
    amp("run", "--out", out, "--max-steps", "2", SCRIPTS / "no_watch_overflow.py")
    j, c = tmp_path / "new" / "r.json", tmp_path / "other" / "t.csv"
    r = amp("report", out, "--json", j, "--csv", c)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert json.loads(j.read_text())["layers"] and c.read_text().startswith("kind,layer")
    r = amp("report", out, "--json", "/proc/no/r.json")  # a folder that cannot be made: said, no traceback
    assert r.returncode == 1 and "could not write JSON report /proc/no/r.json" in r.stderr
    assert "Traceback" not in r.stderr
    r = amp("run", "--out", tmp_path / "k", "--kinds", "activations", SCRIPTS / "no_watch_overflow.py")
    assert r.returncode == 2 and "unknown kind" in r.stderr
    assert not (tmp_path / "k").exists()  # the script did not run first


def test_fix_says_which_object_model_is_when_the_watch_rooted_at_an_inner_module(tmp_path):
    """Lightning's training_step calling ``self.model(x)``: the automatic watch roots at the inner module
    (the first module the script calls), so ``keep_fp32(model.hidden)`` means that module, not the
    LightningModule (``lit.hidden`` is an AttributeError). The fix names the class that ``model`` is."""
    script = tmp_path / "lit_like.py"
    script.write_text(
        "import torch\nfrom torch import nn\n\n\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.inp, self.hidden, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)\n"
        "        with torch.no_grad():\n"
        "            self.hidden.weight.fill_(3000.0)\n\n"
        "    def forward(self, x):\n"
        "        return self.out(torch.relu(self.hidden(self.inp(x))))\n\n\n"
        "class LitModel(nn.Module):  # stands in for a LightningModule: the trainer calls training_step\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.model = Net()\n\n"
        "    def training_step(self, x):\n"
        "        return self.model(x).float().pow(2).mean()\n\n\n"
        "torch.manual_seed(0)\n"
        "lit = LitModel()\n"
        "opt = torch.optim.SGD(lit.parameters(), 1e-4)\n"
        "scaler = torch.amp.GradScaler('cpu')\n"
        "for step in range(3):\n"
        "    with torch.autocast('cpu', dtype=torch.float16):\n"
        "        loss = lit.training_step(torch.randn(4, 8) * 10)\n"
        "    scaler.scale(loss).backward()\n"
        "    scaler.step(opt)\n"
        "    scaler.update()\n"
        "    opt.zero_grad()\n")
    out = tmp_path / "run"
    p = amp("run", "--out", out, "--html", tmp_path / "r.html", script)
    assert p.returncode == 0, p.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["diagnosis"]["first_nonfinite"]["layer"] == "hidden", report["diagnosis"]
    fix = next(a for a in report["advice"] if "keep_fp32(model.hidden)" in a)
    assert "(`model`: your Net object)" in fix, fix
    assert "# model: your Net object" in (tmp_path / "r.html").read_text()


def test_report_of_a_bisect_folder_without_a_baseline_trace(tmp_path):
    """A bisect folder whose baseline left no trace (it crashed before writing one, or a folder from an older
    in-process bisect): `ampdoctor report` says what the folder is and where its result is, no traceback."""
    (tmp_path / "bisect.json").write_text(json.dumps({"verdict": "error", "culprits": [], "trials": []}))
    p = amp("report", tmp_path)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    assert "is a bisect folder that holds no trace of its baseline run (verdict: error)" in p.stderr, p.stderr
    assert str(tmp_path / "bisect.json") in p.stderr


def test_a_closure_steps_loss_is_the_first_closure_calls(tmp_path):
    """LBFGS: step(closure) runs the closure about 20 times a step; the step's loss is what step()
    returns (the first call's), not the sum of every call's (9-16x too high). Under `run` the watch
    starts inside the first closure, after that step began."""
    out = tmp_path / "run"
    r = amp("run", "--out", out, SCRIPTS / "lbfgs_closure.py")
    assert r.returncode == 0, r.stderr
    printed = [float(line.split()[1]) for line in r.stdout.splitlines() if line.startswith("loss ")]
    steps = TraceReader(out / "trace.sqlite").steps()
    assert len(printed) == 3 and [s["loss"] for s in steps] == pytest.approx(printed, rel=1e-6), (steps, printed)


def test_sigterm_ends_a_run_as_ctrl_c_does(tmp_path):
    """SIGTERM (SLURM's and Kubernetes' stop, `kill`) to `ampdoctor run`: the report of the steps so far
    is written and the exit status is 143. It died at once, with no report and the trace marked running."""
    import signal
    import time

    out = tmp_path / "run"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("AMPDOCTOR_CONFIG", None)
    p = subprocess.Popen([sys.executable, "-m", "ampdoctor", "run", "--out", str(out), str(SCRIPTS / "hangs.py")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    deadline = time.time() + 60
    while time.time() < deadline:  # the script sleeps once its step is taken
        if (out / "trace.sqlite").exists() and TraceReader(out / "trace.sqlite").steps():
            break
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=60)
    assert p.returncode == 143, stderr
    rep = json.loads((out / "report.json").read_text())
    assert any("interrupted (SIGTERM)" in line for line in rep["diagnosis"]["lines"]), rep["diagnosis"]
    assert rep["meta"]["status"] == "interrupted" and len(rep["timeline"]) == 1


def test_a_script_that_leaves_out_every_nan_step_broke_it_did_not_train_nothing(tmp_path):
    """`if not loss.isfinite(): continue` from the first forward on: no optimizer step ever runs. `run` said
    "never trained ... Check that the script runs its training loop with these arguments" under a report
    saying training broke at step 0, and bisect gave up with verdict error ("the script never trained")."""
    r = amp("run", "--out", tmp_path / "run", SCRIPTS / "skips_nonfinite_steps.py")
    assert r.returncode == 3, r.stdout + r.stderr
    assert "Training broke at step 0" in r.stdout, r.stdout
    err = " ".join(r.stderr.split())
    assert "took no optimizer step: training broke at step 0" in err and "never trained" not in err, err
    r = amp("bisect", "--out", tmp_path / "b", SCRIPTS / "skips_nonfinite_steps.py", timeout=300)
    res = json.loads((tmp_path / "b" / "bisect.json").read_text())
    assert res["verdict"] == "culprit" and res["failure"] == {"step": 0, "reason": "nonfinite_loss"}, res
    assert res["culprits"][0] == "0", res["culprits"]
    assert r.returncode == 0, r.stdout + r.stderr
