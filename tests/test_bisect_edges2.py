"""bisect edges: hints that skip layers which only pass a NaN along, the baseline trace of an
interrupted bisect, and a Ctrl-C that lands while a trial is being started."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import SoftCube, bisect_until_trial

ROOT = Path(__file__).parent.parent
FIXTURES = ROOT / "fixtures"


# -- hints: a layer that passes a NaN along is not hinted -----------------------------------------

def _branch(gain):
    from torch import nn

    t = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), nn.LayerNorm(16), nn.ReLU())
    with torch.no_grad():
        t[1].weight.mul_(gain)
    return t


class _TwoBranches(torch.nn.Module):
    """fixtures/two_culprits.py in small: ``a.1`` overflows to Inf at step 3, ``a.2`` (LayerNorm) turns
    it into NaN, which ``a.3``, ``a``, ``head.*`` and the root pass along; ``b.1`` overflows at step 5.
    Both must be kept in FP32."""

    def __init__(self):
        super().__init__()
        self.a, self.b = _branch(1000), _branch(700)
        self.head = torch.nn.Sequential(torch.nn.Linear(32, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

    def forward(self, x):
        return self.head(torch.cat([self.a(x), self.b(x)], -1))


def _train_two_branches(steps: int = 20) -> None:
    torch.manual_seed(0)
    model = _TwoBranches()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    scaler = torch.amp.GradScaler("cpu")
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = (1 + step) * 30 + torch.randn(16, 8, generator=gen)  # drifts upwards, never normalised
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def test_hints_skip_the_layers_that_pass_the_first_nan_along(tmp_path):
    """The producer (``a.1``) alone does not fix training (``b.1`` is needed too), so the next hints
    were tried: the layers with the most NaN/Inf values, ``a.2`` and ``a.3``, whose outputs were
    non-finite only because their inputs were (the trace's first_nonfinite event says so: one
    producer, and its ancestors). Two trials for nothing: 12 where 10 do."""
    import ampdoctor
    from ampdoctor.bisect.candidates import read_baseline

    res = ampdoctor.bisect(_train_two_branches, out=tmp_path, drill=False)
    assert res["verdict"] == "culprit" and res["culprits"] == ["a.1", "b.1"], res
    assert res["first_nonfinite"] == {"layer": "a.1", "kind": "activation", "step": 3}, res
    tried_alone = {t["fp32"][0] for t in res["trials"] if len(t["fp32"]) == 1}
    assert not tried_alone & {"a.2", "a.3", "a", "head", "head.0", "head.1", "head.2"}, res["trials"]
    search = [t for t in res["trials"] if not t.get("confirm")]
    assert len(search) == 10, [(t["fp32"], t["outcome"]) for t in res["trials"]]
    # and one more: the culprits run as far as the all-FP32 control
    assert [(t["fp32"], t["outcome"]) for t in res["trials"] if t.get("confirm")] == [(["a.1", "b.1"], "pass")]
    assert read_baseline(tmp_path / "trials" / "00-baseline" / "trace.sqlite").hints == ["a.1"]


# (name, type, parent): ord is the position, as the watch records it (a container before its children)
_TREE = [("", "Net", None), ("a", "Sequential", ""), ("a.0", "Linear", "a"), ("a.1", "LayerNorm", "a"),
         ("b", "Sequential", ""), ("b.0", "Linear", "b"), ("b.1", "LayerNorm", "b"), ("head", "Linear", "")]


def _trace(path, rows, event):
    """A baseline trace written directly: ``rows`` {step: {layer: (nan, posinf, overflow)}} activation
    rows (64 values each), ``event`` the forward first_nonfinite event's (step, layer, detail)."""
    from ampdoctor.trace import TraceWriter

    ids = {name: i for i, (name, _, _) in enumerate(_TREE)}
    w = TraceWriter(path)
    w.add_layers([(i, n, t, i, int(not any(p == n for _, _, p in _TREE)), None if p is None else ids[p])
                  for i, (n, t, p) in enumerate(_TREE)])
    for step in range(max(rows) + 1):
        for name in ids:
            nan, inf, over = rows.get(step, {}).get(name, (0, 0, 0))
            w.add_stats([(step, ids[name], "activation", "out", 0, "float16", 64, 128, nan, inf, 0, 0,
                          -1.0, 1.0, 1.0, 0.5, over, 0, 0, None)])
        w.add_step((step, float("nan") if step in rows and rows[step] else 1.0, 1024.0, 0, step + 1, 1, float(step)))
    step, layer, detail = event
    w.add_event(step, "first_nonfinite", layer, kind="activation", call=0, **detail)
    w.close()
    return path


def test_read_baseline_ranks_no_pass_through_layer_among_the_worst(tmp_path):
    """``a.0`` makes Inf at step 1 (the event: 3 producers, ``a.0`` and its ancestors ``a`` and the
    root); ``a.1`` (a LayerNorm) turns it into NaN in all 64 values, which ``a`` returns: by their
    counts these two were the worst layers, hinted right after it. ``head`` passes the NaN along too,
    but its finite overflow at step 0, before its input went NaN, is its own and still counts."""
    from ampdoctor.bisect.candidates import read_baseline

    nan_a = {"a.0": (0, 2, 0), "a.1": (64, 0, 0), "a": (64, 0, 0), "head": (1, 0, 0), "": (1, 0, 0)}
    rows = {0: {"head": (0, 0, 3)}, 1: nan_a, 2: nan_a}
    event = (1, "a.0", {"producers": 3})
    assert read_baseline(_trace(tmp_path / "t.sqlite", rows, event)).hints == ["a.0", "head"]
    # another module made NaN/Inf at step 1 too (4 producers): the trace cannot say which, nothing is left out
    event = (1, "a.0", {"producers": 4})
    assert "a.1" in read_baseline(_trace(tmp_path / "u.sqlite", rows, event)).hints
    # the data was NaN (no producer): every module non-finite at step 1 passed it along
    event = (1, "a.0", {"producers": 0, "input_nonfinite": True})
    assert read_baseline(_trace(tmp_path / "v.sqlite", rows, event)).hints == ["head"]
    # a later step, no event: b.0 is not the first module run that went non-finite there (a.0 is), so it
    # may be passing a.0's NaN along; its LayerNorm and container are not hinted before it in any case
    later = {**nan_a, "b.0": (0, 1, 0), "b.1": (64, 0, 0), "b": (64, 0, 0)}
    rows = {1: nan_a, 2: later, 3: later}
    hints = read_baseline(_trace(tmp_path / "w.sqlite", rows, (1, "a.0", {"producers": 3}))).hints
    assert hints == ["a.0"], hints


# -- an interrupted bisect keeps a finished baseline's trace ------------------------------------------

BREAKS_THEN_HANGS = """
import os, sys, time, torch
from torch import nn
torch.set_num_threads(1)
torch.manual_seed(0)
marker = sys.argv[1]
baseline = not os.path.exists(marker + ".ran")  # the first trial
open(marker + ".ran", "a").close()
model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
for step in range(100):
    if not baseline and step == 2:  # the next trial: it hangs, until bisect is interrupted
        with open(marker + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(marker + ".tmp", marker)
        while True:
            time.sleep(0.1)
    x = torch.randn(4, 8) * (1e6 if baseline else 1.0)  # beyond fp16's max: the baseline's loss is NaN
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).float().pow(2).mean()
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups, as a terminal's job")
@pytest.mark.parametrize("sig,status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl-c", "sigterm"])
def test_interrupted_bisect_keeps_the_finished_baseline_trace(tmp_path, sig, status):
    """Ctrl-C (or SIGTERM) after the baseline trial finished: its trace stayed under trials/ only, and
    `ampdoctor report OUT` said "no baseline trace yet (interrupted?)"; it is kept as trace.sqlite,
    where a finished bisect keeps it, beside the interrupted result."""
    script, marker, out = tmp_path / "breaks_then_hangs.py", tmp_path / "trial.pid", tmp_path / "b"
    script.write_text(BREAKS_THEN_HANGS)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for k in ("AMPDOCTOR_CONFIG", "AMPDOCTOR_TRACE_WRITER"):
        env.pop(k, None)
    with bisect_until_trial(script, marker, out, tmp_path / "r.json", env, wait=120) as (p, trial):
        if sig == signal.SIGINT:
            os.killpg(p.pid, sig)  # what Ctrl-C in a terminal does
        else:
            os.kill(p.pid, sig)
        _, err = p.communicate(timeout=30)
        assert p.returncode == status, err
        assert f"the baseline's report: ampdoctor report {out}" in err.splitlines()[-1], err
        res = json.loads((tmp_path / "r.json").read_text())
        assert res["verdict"] == "error" and res["exit_status"] == status and "interrupted" in res["error"], res
        assert [t["outcome"] for t in res["trials"]] == ["fail"], res["trials"]  # the baseline; the hung one is not
        assert (out / "trace.sqlite").exists(), sorted(x.name for x in out.iterdir())
        rep = subprocess.run([sys.executable, "-m", "ampdoctor", "report", out], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=120)
        assert rep.returncode == 0, rep.stdout + rep.stderr
        assert "no baseline trace yet" not in rep.stdout + rep.stderr, rep.stdout


# -- a Ctrl-C between a trial's start and its registration ------------------------------------------

@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork, process groups")
@pytest.mark.parametrize("how", ["popen", "fork"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_an_interrupt_right_after_a_trial_started_still_ends_it(tmp_path, monkeypatch, how, sig):
    """Ctrl-C (or the CLI's SIGTERM) landing right after the trial's process was created, before the
    runner had registered it among the running trials: stop_all() (what bisect does on an interrupt)
    did not know it, and the trial, in a session of its own where the terminal's Ctrl-C does not reach
    it, ran on. The signal is sent where a real one can land: when the child exists, inside Popen
    (or the fork) or just after it."""
    from ampdoctor.bisect import trials
    from ampdoctor.bisect.cli import _terminated

    runner = trials.TrialRunner(str(ROOT / "tests" / "scripts" / "hangs.py"), [], tmp_path, oracle={}, timeout=60,
                                fork=how == "fork")
    if how == "fork" and not runner.fork:
        pytest.skip("trials are not forked here (a GPU is visible)")
    made = []

    def interrupted_right_after(make):
        def wrapper(*a, **kw):
            proc = make(*a, **kw)
            made.append(proc)
            os.kill(os.getpid(), sig)  # (os.kill runs the Python handler before it returns)
            return proc
        return wrapper

    if how == "fork":
        monkeypatch.setattr(trials, "_fork_trial", interrupted_right_after(trials._fork_trial))
    else:
        monkeypatch.setattr(trials.subprocess, "Popen", interrupted_right_after(subprocess.Popen))
    saved = signal.signal(signal.SIGINT, signal.default_int_handler), signal.signal(signal.SIGTERM, _terminated)
    try:
        with pytest.raises(KeyboardInterrupt):
            runner.start("started", [], pass_after=None)
        runner.stop_all()
        assert len(made) == 1 and made[0].poll() is not None, "the trial outlived the interrupt"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGTERM) is _terminated
    finally:
        signal.signal(signal.SIGINT, saved[0])
        signal.signal(signal.SIGTERM, saved[1])
        for proc in made:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


# -- hints: the layer whose gradient first went non-finite, not a start-up backoff's ------------------

class _CubeNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(16, 64)
        self.act = torch.nn.Module()
        self.act.forward = lambda x: SoftCube.apply(x)
        self.l2 = torch.nn.Linear(64, 1)

    def forward(self, x):
        return self.l2(self.act(self.l1(x)))


def _train_cube(steps: int = 40) -> None:
    torch.manual_seed(0)
    m = _CubeNet()
    opt = torch.optim.SGD(m.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(steps):
        x = torch.randn(32, 16) * (1 + 4 * step)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(m(x).float(), torch.full((32, 1), 30.0))
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def test_the_layer_whose_gradient_went_nonfinite_is_tried_first(tmp_path):
    """The loss's scaled gradient overflows at the start-up backoffs (the run's one backward
    first_nonfinite event, from the loss); from step 19 ``act``'s backward overflows while the scale
    collapses. The diagnosis named ``act``, but no hint did, so the search tried ``l1`` first, which
    passes too (its FP32 output makes ``act`` compute in FP32), and named ``l1`` the culprit."""
    import ampdoctor
    from ampdoctor.bisect.candidates import read_baseline

    res = ampdoctor.bisect(_train_cube, out=tmp_path, drill=False)
    assert res["first_nonfinite"] == {"layer": "act", "kind": "gradient", "step": 19}, res
    assert res["verdict"] == "culprit" and res["culprits"] == ["act"], res
    bl = read_baseline(tmp_path / "trials" / "00-baseline" / "trace.sqlite", 19, "scale_collapse")
    assert bl.hints[:1] == ["act"], bl.hints


# -- the model's own forward code made the first NaN/Inf ------------------------------------------------

class _Tempered(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU())
        self.head = torch.nn.Linear(64, 8)

    def forward(self, x):
        logits = self.head(self.body(x))
        return logits / 1e-3  # TEMPERATURE: overflows fp16 once |logits| > 65.5


def _train_tempered(steps: int = 40) -> None:
    torch.manual_seed(0)
    m = _Tempered()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(32, 16, generator=g) * (1 + 10 * step)
        y = torch.randint(0, 8, (32,), generator=g)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(m(x).float(), y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def test_an_overflow_in_the_models_own_forward_code_is_named_there(tmp_path):
    """A division by a temperature in the model's own forward (outside its submodules) overflows fp16. bisect
    named ``head`` (its FP32 output makes the division run in FP32) with no op line and nothing about the
    division; now it names the division's line as the cause, ``head`` as the workaround."""
    import inspect

    import ampdoctor
    from ampdoctor.bisect.cli import _summary

    res = ampdoctor.bisect(_train_tempered, out=tmp_path)
    assert res["verdict"] == "culprit" and res["culprits"] == ["head"], res
    assert res["first_nonfinite"]["layer"] == "" and res["first_nonfinite"]["kind"] == "activation", res
    line = next(i for i, t in enumerate(inspect.getsource(sys.modules[__name__]).splitlines(), 1)
                if "# TEMPERATURE" in t and "enumerate" not in t)
    own = [o for o in res["ops"] if o["layer"] == ""]
    assert [(o["op"], o["where"], o["phase"]) for o in own] == [("div", f"test_bisect_edges2.py:{line}", "forward")], \
        res["ops"]
    assert res["advice"][0].startswith("The first NaN/Inf was made in _Tempered.forward's own code (`div` at "
                                       f"test_bisect_edges2.py:{line}"), res["advice"]
    assert "keeping head in FP32 passes because its FP32 output makes that code run in FP32" in res["advice"][0]
    assert any(line.startswith("cause: The first NaN/Inf was made in") for line in _summary(res).splitlines())


def _train_one_linear(steps: int = 20) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), 1e-6)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(steps):
        x = torch.randn(16, 8) * (1 + step) * 3000  # its output passes 65504 after a few steps
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean() * 1e-12
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def test_a_culprit_that_is_the_whole_model_is_not_confirmed_twice(tmp_path):
    """The culprit is the all-FP32 control's own set (a model that is one Linear): that trial already ran as far
    as the confirm would, so no confirm trial runs, and confirmed_to is the step it reached."""
    import ampdoctor

    res = ampdoctor.bisect(_train_one_linear, out=tmp_path, drill=False)
    assert res["verdict"] == "culprit" and res["culprits"] == [""], res
    assert not any(t.get("confirm") for t in res["trials"]), res["trials"]
    assert res["confirmed_to"] == res["control_pass_after"] == 20, res  # (the script ends after 20 steps)
