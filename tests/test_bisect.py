"""bisect end to end: the fixtures' expected verdicts and culprits, trial classification, the API."""

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ampdoctor.bisect.trials import TrialRunner
from ampdoctor.trace import TraceReader

ROOT = Path(__file__).parent.parent
FIXTURES = ROOT / "fixtures"
SCRIPTS = Path(__file__).parent / "scripts"
EXPECTED = json.loads((FIXTURES / "EXPECTED.json").read_text()) if (FIXTURES / "EXPECTED.json").exists() else {}


def bisect(*args, timeout=600, **env_extra):
    env = dict(os.environ, PYTHONUNBUFFERED="1", **env_extra)
    env.pop("AMPDOCTOR_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "ampdoctor", "bisect", *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=timeout)


def _cases():
    for key, exp in EXPECTED.items():
        if key.startswith("_") or not isinstance(exp, dict) or "verdict" not in exp:
            continue
        yield pytest.param(key, exp, id=key)


@pytest.mark.slow
@pytest.mark.parametrize("key,exp", list(_cases()))
def test_fixture_verdict_and_culprits(tmp_path, key, exp):
    script = exp.get("script") or key.split()[0]
    out = tmp_path / "b"
    p = bisect("--out", out, "--json", tmp_path / "r.json", FIXTURES / script, "--", *exp.get("args", []))
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["verdict"] == exp["verdict"], (p.stdout, p.stderr)
    assert sorted(res["culprits"]) == sorted(exp.get("culprits") or []), p.stdout
    assert p.returncode == {"culprit": 0, "healthy": 0, "error": 1, "not_precision": 3, "inconclusive": 4}[exp["verdict"]]
    assert f"verdict: {exp['verdict']}" in p.stdout
    for t in res["trials"]:
        assert set(t) >= {"fp32", "outcome", "step", "seconds"}
    if exp["verdict"] == "culprit":
        assert res["failure"]["reason"] in ("nonfinite_loss", "nonfinite_params", "scale_collapse", "skipped_steps")
        assert res["ops"] and all(":" in o["where"] for o in res["ops"])
        # every culprit's first overflowing op (two culprits: each drilled with the other forced; with
        # nothing forced the run stopped at the first one's failure, before the second overflowed)
        firsts = {o["layer"]: o["op"] for o in res["ops"] if o["pick"] == "first"}
        for want in exp.get("first_bad_op", []):
            assert firsts.get(want["module"]) == want["op"], (want, res["ops"])
        assert any("ampdoctor.keep_fp32(model" in a for a in res["advice"])
        assert (out / "report.json").exists()
    if exp["verdict"] == "error":
        assert res.get("error") and "Traceback (most recent call last)" not in p.stdout
        # the script's own traceback: on the terminal (stderr), and in the trial's stderr.txt the notes
        # point to (it was empty: the traceback was only in outcome.json)
        assert "The script raised (in trial 00-baseline):\nTraceback (most recent call last):" in p.stderr, p.stderr
        assert f'File "{FIXTURES / script}", line' in p.stderr
        log = out / "trials" / "00-baseline" / "stderr.txt"
        assert f"logs: {log}" in p.stdout and "Traceback (most recent call last)" in log.read_text()


def test_missing_script_is_usage_error(tmp_path):
    p = bisect(tmp_path / "nope.py")
    assert p.returncode == 2 and "script not found" in p.stderr
    p = bisect(tmp_path)
    assert p.returncode == 2 and "is a directory, not a script" in p.stderr


def test_help_shows_the_oracle_defaults():
    """README: --scale-floor (default 1.0), --skip-window (10), --skip-frac (0.5); --help said only
    '[oracle default]' or nothing."""
    from click.testing import CliRunner

    from ampdoctor.bisect.cli import bisect_command

    text = " ".join(CliRunner().invoke(bisect_command, ["--help"]).output.split())
    for opt, default in (("--scale-floor", "1.0"), ("--skip-window", "10"), ("--skip-frac", "0.5")):
        after = text.split(opt + " ", 1)[1].split(" --", 1)[0]
        assert f"[default: {default}]" in after, (opt, after)


def test_inconclusive_summary_names_the_whole_model():
    """A budget exhausted after the all-FP32 control: the smallest set known to pass is the root
    (suspects [""]); the summary printed an empty name."""
    from ampdoctor.bisect.cli import _summary

    res = {"verdict": "inconclusive", "culprits": [], "trials": [], "notes": ["trial budget of 1 exhausted"],
           "suspects": [""], "out": "o"}
    assert "smallest set known to pass: (whole model)" in _summary(res)


def test_torchrun_trial_whose_rank0_was_stopped_takes_the_deciding_rank(tmp_path):
    """Under torchrun a rank that decides ends the others (exit status 75): when rank 0 was stopped
    before it wrote its result, the rank that stopped the run speaks for it (not "the trial process
    died")."""
    r = TrialRunner(str(SCRIPTS / "raises.py"), [], tmp_path, oracle={}, timeout=60)
    folder = tmp_path / "t"
    folder.mkdir()
    (folder / "result.rank1.json").write_text(json.dumps({
        "status": "stopped", "exit_code": 0, "error": None, "traceback": None, "steps": 6, "trained": True,
        "decision": {"outcome": "fail", "step": 4, "reason": "nonfinite_loss"}, "rank": 1}))
    t = r._classify({"folder": folder, "index": 1, "name": "x", "fp32": []}, 1, False, 1.0)
    assert t.outcome == "fail" and t.step == 4 and t.reason == "nonfinite_loss", t
    (folder / "result.rank1.json").unlink()
    t = r._classify({"folder": folder, "index": 1, "name": "x", "fp32": []}, 1, False, 1.0)
    assert t.outcome == "error" and "died" in t.error


def test_trial_classification(tmp_path):
    r = TrialRunner(str(SCRIPTS / "raises_on_nan.py"), [], tmp_path, oracle={}, timeout=60)
    t = r.run("nan-raise", [], pass_after=None)
    assert t.outcome == "fail" and t.reason == "nonfinite_loss" and "raised after the loss" in t.error
    t = r.run("nan-raise-lite", [], pass_after=None, lite=True)  # a search trial records no layer statistics
    assert t.outcome == "fail" and t.reason == "nonfinite_loss", t
    r = TrialRunner(str(SCRIPTS / "raises.py"), [], tmp_path / "2", oracle={}, timeout=60)
    t = r.run("crash", [], pass_after=None)
    assert t.outcome == "error" and "boom" in t.error
    r = TrialRunner(str(SCRIPTS / "hangs.py"), [], tmp_path / "3", oracle={}, timeout=5)
    t = r.run("hang", [], pass_after=None)
    assert t.outcome == "timeout" and t.seconds < 30
    r = TrialRunner(str(SCRIPTS / "no_training.py"), [], tmp_path / "4", oracle={}, timeout=60)
    assert r.run("idle", [], pass_after=None).outcome == "error"


def test_trial_in_fresh_interpreter(tmp_path):
    r = TrialRunner(str(SCRIPTS / "raises_on_nan.py"), [], tmp_path, oracle={}, timeout=120, fork=False)
    t = r.run("spawned", [], pass_after=None)
    assert t.outcome == "fail"
    assert (tmp_path / "trials" / "00-spawned" / "stderr.txt").exists()


def test_forked_trials_start_with_what_an_optimizer_imports(tmp_path):
    """Forked trials (the bisect command on a machine without a GPU) each imported torch._dynamo when the
    script built its first optimizer: about 1.3-1.7 s of a ~1.9 s trial here. bisect imports it once,
    before the first fork; each trial still runs the script in its own process."""
    script = tmp_path / "s.py"
    script.write_text(
        "import os, sys, torch\n"
        "print('dynamo imported at start:', 'torch._dynamo' in sys.modules, 'pid', os.getpid(), flush=True)\n"
        "m = torch.nn.Linear(4, 1)\n"
        "opt = torch.optim.SGD(m.parameters(), lr=0.01)\n"
        "for _ in range(3):\n"
        "    opt.zero_grad(); m(torch.randn(2, 4)).sum().backward(); opt.step()\n")
    p = bisect("--out", tmp_path / "b", "--json", tmp_path / "r.json", script)
    assert json.loads((tmp_path / "r.json").read_text())["verdict"] == "healthy", p.stdout + p.stderr
    out = (tmp_path / "b" / "trials" / "00-baseline" / "stdout.txt").read_text()
    assert "dynamo imported at start: True" in out, out
    assert f"pid {os.getpid()}" not in out


def _train_overflowing(steps: int, factor: float = 60) -> None:
    """A CPU fp16 training whose second Linear (weights times ``factor``) overflows as the input grows."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 1))
    with torch.no_grad():
        model[2].weight.mul_(factor)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(steps):
        x = torch.randn(8, 8) * (1 + step) * 60
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def _train_accelerate_style(steps: int) -> None:
    """``_train_overflowing`` as HF ``Trainer(fp16=True)`` runs it through accelerate: the loop
    enters no autocast; ``model.forward`` is replaced by one wrapped in ``torch.autocast``."""
    import types

    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 1))
    with torch.no_grad():
        model[2].weight.mul_(60)
    model.forward = types.MethodType(torch.autocast("cpu", dtype=torch.float16)(type(model).forward), model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(steps):
        x = torch.randn(8, 8) * (1 + step) * 60
        loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def test_bisect_of_a_model_whose_forward_enters_autocast_itself(tmp_path):
    """The all-FP32 control must run the whole model in FP32 when autocast is entered inside the
    model's forward (accelerate, HF Trainer): it ran in fp16 there and the verdict was not_precision."""
    import ampdoctor

    res = ampdoctor.bisect(lambda: _train_accelerate_style(60), out=tmp_path)
    controls = {tuple(t["fp32"]): t["outcome"] for t in res["trials"]}
    assert controls[("",)] == "pass", res["trials"]
    assert res["verdict"] == "culprit" and res["culprits"] == ["2"], res


def _train_newgelu(steps: int, trace: Path | None = None):
    """A CPU fp16 training through GPT-2's NewGELU, whose input reaches a few hundred: ``x ** 3``
    overflows inside its forward (the output stays finite), and its backward makes NaN (inf * 0) at
    any loss scale, with no Inf anywhere. ``trace``: watched, and the report returned."""
    import torch
    from torch import nn

    import ampdoctor

    class NewGELU(nn.Module):
        def forward(self, x):
            return 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * torch.pow(x, 3.0))))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), NewGELU(), nn.Linear(32, 32))
    with torch.no_grad():
        model[0].weight.mul_(200)
    w = ampdoctor.watch(model, trace=str(trace)) if trace is not None else None
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(steps):
        x = torch.randn(8, 8)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().tanh().mean() * 0.01
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    if w is not None:
        rep = w.report()
        w.remove()
        return rep


def test_a_backward_that_makes_nan_at_every_scale_is_found_in_a_few_steps(tmp_path):
    """Every step skipped, the loss finite, the gradients NaN without Inf: bisect called such a 6-step
    run healthy (the GradScaler's start-up backoffs may take 20 steps), and the report said "did not
    break" and that the skips were normal start-up backoffs."""
    import ampdoctor

    rep = _train_newgelu(6, tmp_path / "watched.sqlite")
    d = rep.diagnosis
    assert (d.broke, d.step, d.reason, d.optimizer_steps, d.skipped_steps) == (True, 0, "skipped_steps", 0, 6), d
    assert d.first_nonfinite["layer"] == "1" and d.first_nonfinite["kind"] == "gradient", d.first_nonfinite
    assert not any(r.inf for r in rep.layers) and any(r.nan for r in rep.rows("gradient"))
    text = "\n".join(rep.advice)
    assert "keep_fp32(model[1])" in text and "These are not start-up backoffs" in text, text
    res = ampdoctor.bisect(lambda: _train_newgelu(6), out=tmp_path / "bisect")
    assert res["verdict"] == "culprit" and res["culprits"] == ["1"], res
    assert (res["trials"][0]["fp32"], res["trials"][0]["outcome"]) == ([], "fail"), res["trials"]


def _train_scaled_input(steps):
    """The root's forward scales its FP32 input beyond fp16's max before `b` (no module does it):
    `b`'s autocast cast of it overflows. Keeping `b` in FP32 fixes training, but the cause is upstream."""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 1)

        def forward(self, x):
            return self.b(self.a(x).float() * 2e4 + x * 1e5)

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(8, 8)).float().mean() * 1e-6
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def test_bisect_says_when_the_culprits_input_came_in_too_large(tmp_path):
    import ampdoctor

    res = ampdoctor.bisect(lambda: _train_scaled_input(12), out=tmp_path)
    assert res["verdict"] == "culprit" and res["culprits"] == ["b"], res
    assert res["ops"][0]["op"] == "linear" and res["ops"][0]["pick"] == "first", res["ops"]
    assert {o["op"] for o in res["ops"]} == {"linear"}, res["ops"]  # the probe's own look at the input is not an op
    (line,) = [a for a in res["advice"] if a.startswith("The input of b was already beyond fp16's max")]
    assert "the values grow before it" in line, line
    # the run folder holds the baseline's trace as the CLI's does, and its report repeats the line
    from ampdoctor.report import build_report
    assert (tmp_path / "trace.sqlite").exists() and (tmp_path / "bisect.json").exists()
    report = build_report(tmp_path)
    assert report.bisect["culprits"] == ["b"] and line in report.advice, report.advice
    # every output value of b was NaN or Inf: no "largest finite abs-max 0"
    keep = next(a for a in report.advice if a.startswith("Keep b"))
    assert "its output overflowed to Inf (fp16 max 65504; no finite value, " in keep and "largest finite" not in keep, keep


def test_python_api_bisect(tmp_path):
    import random

    import numpy as np
    import torch

    import ampdoctor

    random.seed(123)
    np.random.seed(123)
    torch.manual_seed(123)
    before = random.random(), np.random.rand(), torch.rand(()).item()
    random.seed(123)
    np.random.seed(123)
    torch.manual_seed(123)
    res = ampdoctor.bisect(lambda: _train_overflowing(60), out=tmp_path)
    assert res["verdict"] == "culprit" and res["culprits"] == ["2"], res
    # the trials reseed the global RNGs (seed 0); the caller's streams go on as if bisect had not run
    assert (random.random(), np.random.rand(), torch.rand(()).item()) == before
    assert json.loads((tmp_path / "bisect.json").read_text()) == json.loads(json.dumps(res, allow_nan=False))
    assert len(res["trials"]) <= 5


def test_drill_down_writes_each_op_event_once(tmp_path):
    # the first/worst picks are findings too, and were written twice: once as picks, again among the findings
    import ampdoctor

    res = ampdoctor.bisect(lambda: _train_overflowing(60), out=tmp_path)
    (trace,) = (tmp_path / "trials").glob("*-drill-down/trace.sqlite")
    with TraceReader(trace) as r:
        ops, (probe,) = r.events("op"), r.events("probe")
    keys = [(e["step"], e["layer"], json.dumps({k: v for k, v in e["detail"].items() if k != "pick"}, sort_keys=True))
            for e in ops]
    assert len(keys) == len(set(keys)), keys
    picks = [e["detail"]["pick"] for e in ops]
    assert picks.count("first") == 1 and picks.count("worst") <= 1 and picks.count("worst_backward") <= 1, picks
    # every finding once (a worst pick that did not overflow is written besides them)
    notable = [e for e in ops if e["detail"]["nonfinite"] or e["detail"]["overflow_count"]]
    assert len(notable) == probe["detail"]["findings"] > 0
    line = _line_of(_train_overflowing, "loss = model(x)")
    assert [(o["pick"], o["op"], o["where"]) for o in res["ops"]][0] == ("first", "linear", f"test_bisect.py:{line}")


def _line_of(fn, text: str) -> int:
    src, start = inspect.getsourcelines(fn)
    return start + next(i for i, s in enumerate(src) if text in s)


@pytest.mark.slow
def test_bisect_through_torchrun(tmp_path):
    p = bisect("--out", tmp_path / "b", "--json", tmp_path / "r.json", "--nproc-per-node", "2", SCRIPTS / "ddp_overflow.py")
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["verdict"] == "culprit" and res["culprits"] == ["2"], p.stdout + p.stderr
    # every rank's baseline trace is kept in the run folder (only rank 0's was): `report --rank 1` shows it
    assert (tmp_path / "b" / "trace.sqlite").exists() and (tmp_path / "b" / "trace.rank1.sqlite").exists()
    r = subprocess.run([sys.executable, "-m", "ampdoctor", "report", str(tmp_path / "b"), "--rank", "1"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0 and "trace.rank1.sqlite" in r.stdout.replace("\n", "") and "Diagnosis" in r.stdout, r.stdout


@pytest.mark.cuda
def test_bisect_through_torchrun_nccl(tmp_path):
    """DDP on two GPUs with NCCL: each trial is a torchrun of two ranks, one GPU each."""
    import torch
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    p = bisect("--out", tmp_path / "b", "--json", tmp_path / "r.json", "--nproc-per-node", "2", SCRIPTS / "ddp_overflow.py",
               DDP_DEVICE="cuda")
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["verdict"] == "culprit" and res["culprits"] == ["2"], p.stdout + p.stderr
    assert res["first_nonfinite"]["layer"] == "2", res


@pytest.mark.cuda
def test_bisect_through_torchrun_ddp_on_one_gpu(tmp_path):
    """DDP on CUDA tensors with a machine of one GPU: two ranks share it over gloo (NCCL refuses two
    ranks on one GPU), so the recorder's CUDA path runs under DDP even where two GPUs are not lent."""
    p = bisect("--out", tmp_path / "b", "--json", tmp_path / "r.json", "--nproc-per-node", "2", SCRIPTS / "ddp_overflow.py",
               DDP_DEVICE="cuda", DDP_BACKEND="gloo")
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["verdict"] == "culprit" and res["culprits"] == ["2"], p.stdout + p.stderr
    assert res["first_nonfinite"]["layer"] == "2", res


def test_jobs_and_repeat(tmp_path):
    p = bisect("--out", tmp_path / "j", "--json", tmp_path / "j.json", "--jobs", "2", "--repeat", "2",
               FIXTURES / "linear_overflow.py")
    res = json.loads((tmp_path / "j.json").read_text())
    assert res["verdict"] == "culprit" and res["culprits"] == ["net.2"], p.stdout + p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("trial ")]
    assert [int(ln.split()[1]) for ln in lines] == list(range(1, len(lines) + 1))  # each trial numbered once


@pytest.mark.slow
def test_max_trials_counts_the_same_with_jobs(tmp_path):
    """--jobs 2 runs the first guesses (the all-FP32 control, the hint) side by side before the search;
    they were not counted against --max-trials (--max-trials 1 ran 4 trials and named a culprit)."""
    got = []
    for jobs in ("1", "2"):
        p = bisect("--out", tmp_path / jobs, "--json", tmp_path / f"{jobs}.json", "--jobs", jobs, "--max-trials", "1",
                   "--no-drill", FIXTURES / "linear_overflow.py")
        res = json.loads((tmp_path / f"{jobs}.json").read_text())
        assert res["verdict"] == "inconclusive" and p.returncode == 4, p.stdout + p.stderr
        got.append(len(res["trials"]))
    assert got == [2, 2]  # the baseline and one search trial


def test_fix_snippets_for_autocast_and_pure_half_models():
    from ampdoctor.bisect.driver import fix_snippets

    types = {"blocks.1.fc1": "Linear", "head": "Linear", "blocks.0": "Block"}
    amp = fix_snippets(["blocks.1.fc1", "blocks.0"], types, [])
    assert "ampdoctor.keep_fp32(model.blocks[1].fc1)" in amp[0]
    assert "autocast(x.device.type, enabled=False)" in amp[1] and "Block.forward" in amp[3]
    half = fix_snippets(["head", "blocks.0"], types, [], {"head": "float16", "blocks.0.fc1": "bfloat16"})
    plain = [a for a in half if a.startswith("Plain PyTorch")]
    assert len(plain) == 2 and all("autocast(" not in a and ".float()" in a for a in plain), plain
    assert "float16" in plain[0] and "bfloat16" in plain[1] and "model.head(x.float()).to(x.dtype)" in plain[0]
    # a module of a pure half model with no half weights of its own (a gate): no autocast to turn off either
    # (it said "run the body under `with torch.autocast(x.device.type, enabled=False):`")
    gate = fix_snippets(["blocks.0", "act"], {**types, "act": "GELU"}, [], {"head": "float16"}, model_dtype="float16")
    plain = [a for a in gate if a.startswith("Plain PyTorch")]
    assert len(plain) == 2 and all("autocast(" not in a and "float16 with no autocast" in a for a in plain), plain
    assert "in Block.forward, begin with `dtype, x = x.dtype, x.float()` and return the result `.to(dtype)`" in plain[0]
    assert "where model.act is called, `y = model.act(x.float()).to(x.dtype)`" in plain[1], plain
    # what `model` is (the watched root's class), before the snippet, which still ends the line
    named = fix_snippets(["head"], {**types, "": "Net"}, [])
    assert named[0] == "Keep head (Linear) in FP32 (`model`: your Net object): ampdoctor.keep_fp32(model.head)", named


def test_fix_snippet_of_an_overflowing_power_says_power():
    """GPT-2's NewGELU computes ``x ** 3``: its drill-down op is ``pow``, and the advice said "square"."""
    from ampdoctor.bisect.driver import fix_snippets

    ops = [{"layer": "h.1.mlp.act", "op": op, "where": "activations.py:66", "absmax": 8.67e9, "phase": "forward",
            "pick": "first"} for op in ("pow", "mul", "square")]
    got = fix_snippets(["h.1.mlp.act"], {"h.1.mlp.act": "NewGELUActivation"}, ops)
    said = [a for a in got if "overflows (abs-max 8.67e+09)" in a]
    assert [a.split(": compute ")[1].split(" in FP32")[0] for a in said] == ["the power", "the product", "the square"]


def test_trials_run_past_the_step_where_a_skip_window_failure_shows(tmp_path):
    """A skipped-steps failure is reported at the first step of the window but can only be detected
    steps later; trials passed at the failure step + margin, before their own failure could show, so
    every set "fixed" it (a bogus culprit). Here a 2**40 init_scale backs off for 24 steps (start-up,
    not the failure); then growth_interval=1 doubles the scale after every step taken, so more than
    half of the steps overflow: the window that fails starts at step 27."""
    import torch
    from torch import nn

    import ampdoctor

    def train():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
        opt = torch.optim.Adam(model.parameters(), 1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40, growth_interval=1)
        for _ in range(40):
            x = torch.randn(16, 8)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), x[:, :1] * 3)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

    res = ampdoctor.bisect(train, out=tmp_path, drill=False)
    assert res["failure"]["reason"] == "skipped_steps", res
    base = res["trials"][0]
    assert base["outcome"] == "fail"
    fail_step = res["failure"]["step"]
    assert fail_step > 24, res["failure"]  # after the start-up backoff
    # a window of 10 first trips 6 skipped steps after its first: the trials run past that
    assert res["pass_after"] > fail_step + 10, res["pass_after"]
    for t in res["trials"]:
        if t["outcome"] == "pass":
            assert t["step"] > fail_step + 10, t


def test_not_precision_first_nonfinite_is_not_the_scalers_startup_overflow(tmp_path):
    """NaN data from step 6: no module produces the NaN, so first_nonfinite fell back to the first event of
    all, the scaled weight-gradient overflow of the GradScaler's start-up backoff at step 0 (the report
    says: step 6, the input of 0 was already non-finite)."""
    import torch
    from torch import nn

    import ampdoctor

    def train():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
        opt = torch.optim.Adam(model.parameters(), 1e-3)
        scaler = torch.amp.GradScaler("cpu")
        for step in range(30):
            x = torch.randn(16, 4)
            y = x[:, :1]
            if step >= 6:
                x = x * float("nan")
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

    res = ampdoctor.bisect(train, out=tmp_path, drill=False)
    assert res["verdict"] == "not_precision", res
    assert res["first_nonfinite"]["step"] == 6 and res["first_nonfinite"]["kind"] == "activation", res["first_nonfinite"]


def test_plain_pytorch_fix_runs_when_pasted():
    """The plain-PyTorch snippet named an undefined `device_type` (NameError when pasted)."""
    import re

    import torch
    from torch import nn

    from ampdoctor.bisect.driver import fix_snippets

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    plain = [a for a in fix_snippets(["1"], {"": "Sequential", "1": "Linear"}, []) if a.startswith("Plain PyTorch")][0]
    code = re.search(r"`(with .*?)`", plain).group(1).replace(": y =", ":\n    y =")
    x = torch.randn(2, 4)
    env = {"torch": torch, "model": model, "x": x}
    exec(code, env)
    assert env["y"].dtype == torch.float32


def test_repeat_majority_decides_the_baseline_too(tmp_path):
    """--repeat R is for flaky failures, but the baseline ran once: a lucky first run gave `healthy`
    although most runs of the script break."""

    import ampdoctor

    calls = {"n": 0}

    def train():
        calls["n"] += 1
        _train_overflowing(40, 1 if calls["n"] == 1 else 60)  # only the very first run does not break

    res = ampdoctor.bisect(train, out=tmp_path, repeat=3, drill=False)
    assert res["verdict"] == "culprit" and res["culprits"] == ["2"], res
    assert any("flaky" in n for n in res["notes"]), res["notes"]


def test_baseline_first_nonfinite_of_a_scale_collapse_is_at_the_failure(tmp_path):
    """Only GradScaler-scaled gradient events (a scale that collapses): the first non-finite value
    bisect reports is the one at or after the failure step, as the report's, not the start-up
    backoff at step 0."""
    from ampdoctor.bisect.candidates import read_baseline
    from ampdoctor.trace import TraceWriter

    w = TraceWriter(tmp_path / "t.sqlite")
    w.add_layers([(0, "", "Sequential", 0, 0, None), (1, "0", "Linear", 1, 1, 0), (2, "1", "Linear", 2, 1, 0)])
    w.add_event(0, "first_nonfinite", "1", kind="gradient", scaled=True)
    for step, layer in ((0, "1"), (5, "1"), (20, "0"), (21, "0")):
        w.add_event(step, "grad_nonfinite", layer, kind="gradient", scaled=True)
    w.close()
    assert read_baseline(tmp_path / "t.sqlite").first_nonfinite == {"layer": "1", "kind": "gradient", "step": 0}
    got = read_baseline(tmp_path / "t.sqlite", 20, "scale_collapse")
    assert got.first_nonfinite == {"layer": "0", "kind": "gradient", "step": 20}
    # and the search tries that layer first, not the start-up backoff's (it named "1")
    assert got.hints == ["0"], got.hints


def test_fix_snippets_name_the_model_inside_a_ddp_wrapper():
    from ampdoctor.bisect.driver import fix_snippets

    plain = fix_snippets(["2"], {"2": "Linear"}, [])
    ddp = fix_snippets(["2"], {"2": "Linear"}, [], None, "DistributedDataParallel")
    assert "inside" not in plain[0] and "ampdoctor.keep_fp32(model[2])" in ddp[0]
    assert "inside DistributedDataParallel" in ddp[0] and "before wrapping" in ddp[0]


def test_ddp_fix_snippet_says_a_pure_half_model_is_fixed_before_wrapping():
    """keep_fp32(ddp.module[0]) on a pure .half() DDP model fails at the next backward (DDP's
    'Expected to have finished reduction' error: its buckets hold fp16 parameters); the hint offered
    `wrapped.module` without that condition."""
    from ampdoctor.bisect.driver import fix_snippets

    ddp = fix_snippets(["2"], {"2": "Linear"}, [], None, "DistributedDataParallel")[0]
    assert "under autocast" in ddp and "pure .half()/.bfloat16() model must be fixed before wrapping" in ddp


@pytest.mark.parametrize("code,verdict", [(0, "healthy"), (2, "error")])
def test_python_api_bisect_of_a_function_that_calls_sys_exit(tmp_path, code, verdict):
    # a function made from a script's main(): sys.exit() ends its trial as it ends a trial process, and
    # does not end ampdoctor.bisect (in a notebook: the whole call, with no result)
    import torch
    from torch import nn

    def train():
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        sys.exit(code)

    import ampdoctor

    res = ampdoctor.bisect(train, out=tmp_path, drill=False)
    assert res["verdict"] == verdict
    if code:
        assert "sys.exit(2)" in res["error"]


def test_python_api_bisect_refuses_a_model_up_front(tmp_path):
    import torch

    import ampdoctor

    with pytest.raises(TypeError, match="got a model"):
        ampdoctor.bisect(torch.nn.Linear(2, 2), out=tmp_path)
    with pytest.raises(TypeError, match="got int"):
        ampdoctor.bisect(3, out=tmp_path)


def test_cli_summary_labels_fixes_and_an_input_that_came_in_too_large():
    """The terminal summary prints the fixes as `fix:` and bisect's line about a culprit's input that
    was already too large (the cause lies in the code before it) as `cause:`."""
    from ampdoctor.bisect.cli import _summary

    res = {"verdict": "culprit", "culprits": ["b"], "trials": [], "out": "/tmp/x", "ops": [],
           "advice": ["Keep b (Linear) in FP32: ampdoctor.keep_fp32(model.b)",
                      "The input of b was already beyond fp16's max when it was called (abs-max 2.5e+05, step 0): ..."]}
    lines = _summary(res).splitlines()
    assert "fix: Keep b (Linear) in FP32: ampdoctor.keep_fp32(model.b)" in lines
    assert any(line.startswith("cause: The input of b was already beyond") for line in lines), lines
    assert not any(line.startswith("fix: The input of") for line in lines)


def test_cli_summary_says_worst_op_in_backward_in_words():
    """The drill-down's worst backward op printed as "worst_backward op in res.fc", indented off the
    other op lines: it reads "worst op in res.fc: ... (backward, ...)" like them (bisect.json keeps its pick)."""
    from ampdoctor.bisect.cli import _summary

    ops = [{"layer": "b", "op": op, "where": "m.py:3", "absmax": 7.0, "phase": phase, "pick": pick}
           for op, phase, pick in (("linear", "forward", "first"), ("mul", "backward", "worst_backward"))]
    lines = _summary({"verdict": "culprit", "culprits": ["b"], "trials": [], "out": "/tmp/x", "ops": ops}).splitlines()
    assert "   first op in b: linear at m.py:3 (forward, abs-max 7)" in lines, lines
    assert "   worst op in b: mul at m.py:3 (backward, abs-max 7)" in lines, lines
    assert not any("worst_backward" in line for line in lines), lines


def test_a_loss_that_overflows_outside_the_model_is_said_to_be_the_loss(tmp_path):
    """A loss computed in fp16 in user code (exp of a finite output) made the first Inf. bisect named the
    last Linear, said its gradient "came in non-finite from outside the layer", and bisect.json had no
    ``from_loss``; ``run`` said to compute the loss in FP32. Now bisect says so too, first."""
    r = bisect("--out", tmp_path / "b", SCRIPTS / "loss_overflow.py")
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((tmp_path / "b" / "bisect.json").read_text())
    assert res["verdict"] == "culprit" and res["culprits"] == ["2"], res
    assert res["first_nonfinite"] == {"layer": "2", "kind": "gradient", "step": 0, "from_loss": True,
                                      "loss_nonfinite": True}, res["first_nonfinite"]
    assert res["advice"][0].startswith("The loss overflowed outside the model (the loss was already non-finite at "
                                       "step 0 while every watched layer's output was finite): compute the loss in "
                                       "FP32"), res["advice"]
    assert "keeping 2 in FP32 passes because its FP32 output makes the loss's ops run in FP32" in res["advice"][0]
    out = " ".join(r.stdout.split())
    assert "first non-finite: the gradient reaching 2 from the loss at step 0" in out, out
    assert "came in non-finite from the loss" in out and "from outside the layer" not in out, out
    from ampdoctor.report import build_report
    report = build_report(tmp_path / "b")
    assert report.advice[0] == res["advice"][0], report.advice
    text = "\n".join(report.advice)
    assert "Fix that layer" not in text and "see the first non-finite producer" not in text, text


def test_horizons_are_the_steps_run_when_the_script_ends_before_them(tmp_path):
    """linear_overflow fails at step 18; with --steps 22 the script ends before the trials' horizon (27) and
    the control's (54). bisect.json claimed pass_after 27 and control_pass_after 54: steps no trial ran."""
    r = bisect("--out", tmp_path / "b", FIXTURES / "linear_overflow.py", "--steps", "22")
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((tmp_path / "b" / "bisect.json").read_text())
    assert res["verdict"] == "culprit" and res["culprits"] == ["net.2"], res
    passed = [t["step"] for t in res["trials"] if t["outcome"] == "pass"]
    assert passed and set(passed) == {22}, res["trials"]
    assert (res["pass_after"], res["control_pass_after"]) == (22, 22), res
    assert not any(t.get("confirm") for t in res["trials"]) and "confirmed_to" not in res, res  # nothing further to run
    (note,) = [n for n in res["notes"] if n.startswith("the script ended after 22 steps")]
    assert "before step 27 (the failure step plus the margin)" in note and "control's step 54" in note, note
    assert "note: the script ended after 22 steps" in r.stdout, r.stdout
    # a script that runs on past the horizons keeps them
    r = bisect("--out", tmp_path / "c", FIXTURES / "linear_overflow.py", "--steps", "60")
    res = json.loads((tmp_path / "c" / "bisect.json").read_text())
    assert (res["pass_after"], res["control_pass_after"]) == (27, 54), res
    assert not any(n.startswith("the script ended") for n in res.get("notes", [])), res["notes"]
    # the culprit is run as far as the all-FP32 control: it holds there
    assert [(t["fp32"], t["outcome"], t["step"]) for t in res["trials"] if t.get("confirm")] == [(["net.2"], "pass", 54)]
    assert res["confirmed_to"] == 54, res


def test_a_second_overflow_after_the_trials_horizon_is_found_too(tmp_path):
    """Two ramps overflow, 0.0 from step 11 and 0.3 from step 23. Trials pass at step 16 (the failure step plus
    the margin), so forcing 0.0 alone passed, and bisect named 0.0 alone: the run with that fix broke at step 23.
    The culprits found are now run as far as the all-FP32 control (step 32); that run fails, so the search runs
    again with every trial run to step 32, and finds both."""
    r = bisect("--out", tmp_path / "b", SCRIPTS / "second_overflow_later.py")
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((tmp_path / "b" / "bisect.json").read_text())
    assert res["verdict"] == "culprit" and res["culprits"] == ["0.0", "0.3"], res
    assert [(t["fp32"], t["outcome"], t["step"]) for t in res["trials"] if t.get("confirm")] == [(["0.0"], "fail", 23)]
    assert (res["pass_after"], res["control_pass_after"], res["confirmed_to"]) == (32, 32, 32), res
    assert ["0.0", "0.3"] in [t["fp32"] for t in res["trials"] if t["outcome"] == "pass" and t["step"] == 32]
    (note,) = [n for n in res["notes"] if n.startswith("with 0.0 in FP32")]
    assert "passed step 16 but broke at step 23" in note and "every trial run to step 32" in note, note
    assert "confirm, as far as the all-FP32 control" in r.stderr, r.stderr
    first = {o["layer"]: o["op"] for o in res["ops"] if o["pick"] == "first"}
    assert first == {"0.0": "mul", "0.3": "mul"}, res["ops"]


def test_a_bf16_script_is_bisected_against_bf16(tmp_path):
    """bisect measured every script against fp16 unless told otherwise: on a pure bf16 model whose one-pass
    variance cancels into a negative number (rsqrt: NaN), it printed 'fix: mul ... overflows (abs-max 9.37e+04):
    compute the product in FP32', an overflow bf16 cannot have. Its format is now the baseline's (auto)."""
    r = bisect("--out", tmp_path / "b", SCRIPTS / "bf16_one_pass_variance.py")
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((tmp_path / "b" / "bisect.json").read_text())
    assert res["verdict"] == "culprit" and res["culprits"] == ["0"], res
    first = [o for o in res["ops"] if o["pick"] == "first"]
    assert [(o["op"], o["where"]) for o in first] == [("rsqrt", "bf16_one_pass_variance.py:18")], res["ops"]
    assert not any("overflows" in a for a in res["advice"]), res["advice"]
    formats = {json.loads((tmp_path / "b" / "trials" / t / "config.json").read_text())["format"]
               for t in os.listdir(tmp_path / "b" / "trials") if t != "00-baseline"}
    assert formats == {"bf16"}, formats
