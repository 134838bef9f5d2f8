"""Regressions found by running scripts written by someone else (new-user testing)."""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import ampdoctor
from ampdoctor.bisect.drill import OpProbe
from ampdoctor.report import build_report
from ampdoctor.trace import TraceReader

ROOT = Path(__file__).parent.parent


def test_disabled_grad_scaler_does_not_double_steps(tmp_path):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # `GradScaler(enabled=use_amp)`
    with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite")):
        for _ in range(5):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    steps = TraceReader(tmp_path / "t.sqlite").steps()
    assert [s["step"] for s in steps] == [0, 1, 2, 3, 4]


def test_gradient_accumulation_loss_is_the_step_loss(tmp_path):
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.ones(2, 4)
    with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite")):
        for _ in range(2):
            total = 0.0
            for _ in range(4):
                loss = model(x).pow(2).mean() / 4
                loss.backward()
                total += loss.item()
            opt.step()
            opt.zero_grad()
    assert TraceReader(tmp_path / "t.sqlite").steps()[0]["loss"] == pytest.approx(total)


def test_checkpoint_recompute_is_not_a_second_call(tmp_path):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
            self.head = nn.Linear(8, 1)

        def forward(self, x):
            return self.head(checkpoint(self.block, x, use_reentrant=False))

    model = M()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite")):
        model(torch.randn(4, 8, requires_grad=True)).pow(2).mean().backward()
        opt.step()
    r = TraceReader(tmp_path / "t.sqlite")
    names = {lay["id"]: lay["name"] for lay in r.layers()}
    calls = [s["call"] for s in r.stats(kind="activation") if names[s["layer"]] == "block.0"]
    assert calls == [0]


def test_causal_mask_fill_is_not_an_overflow():
    class Attn(nn.Module):
        def forward(self, q):
            s = q @ q.transpose(-2, -1)
            mask = torch.ones(s.shape[-2:], dtype=torch.bool).triu(1)
            return torch.softmax(s.masked_fill(mask, float("-inf")).float(), -1)

    model = nn.Sequential(Attn())
    with OpProbe(model, ["0"]) as probe:
        with torch.autocast("cpu", dtype=torch.float16):
            model(torch.randn(2, 4, 8))
    assert not [f for f in probe.findings if f.op == "masked_fill"]


SECOND_MODEL = '''
import torch
from torch import nn

class G(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    def forward(self, z):
        return self.net(z)

class D(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    def forward(self, x):
        return self.net(x)

g, d = G(), D()
og, od = torch.optim.SGD(g.parameters(), lr=1e-2), torch.optim.SGD(d.parameters(), lr=1e-2)
for step in range(3):
    ld = d(g(torch.randn(2, 4)).detach()).mean()
    ld.backward(); od.step(); od.zero_grad()
    lg = -d(g(torch.randn(2, 4))).mean()
    lg.backward(); og.step(); og.zero_grad()
'''


def _run_script(tmp_path, name: str, source: str):
    """``ampdoctor run --out tmp_path/run`` on a script with ``source`` (outside any trial's
    configuration); returns the completed process and the run folder."""
    script = tmp_path / name
    script.write_text(source)
    out = tmp_path / "run"
    env = dict(os.environ)
    env.pop("AMPDOCTOR_CONFIG", None)
    p = subprocess.run([sys.executable, "-m", "ampdoctor", "run", "--out", str(out), str(script)], capture_output=True,
                       text=True, cwd=ROOT, env=env, timeout=120)
    return p, out


def test_second_auto_watched_model_is_named_by_its_class(tmp_path):
    p, out = _run_script(tmp_path, "gan.py", SECOND_MODEL)
    assert p.returncode == 0, p.stderr
    names = {lay["name"] for lay in TraceReader(out / "trace.sqlite").layers()}
    assert {"net.0", "D:", "D:net.0", "D:net.1"} <= names
    r = TraceReader(out / "trace.sqlite")
    # two optimizers: a step is one round of them, D's then G's (see test_steps_frameworks.py)
    assert [s["optimizer_steps"] for s in r.steps()] == [2, 4, 6] and r.meta()["optimizer_steps"] == 6


@pytest.mark.slow
def test_pure_half_model_without_watch_call_bisects(tmp_path):
    src = (ROOT / "fixtures" / "pure_half.py").read_text()
    lines = [ln for ln in src.splitlines() if "ampdoctor.watch(" not in ln]
    script = tmp_path / "pure_half_nowatch.py"
    script.write_text("\n".join(lines) + "\n")
    env = dict(os.environ)
    env.pop("AMPDOCTOR_CONFIG", None)
    p = subprocess.run([sys.executable, "-m", "ampdoctor", "bisect", "--out", str(tmp_path / "b"), "--json",
                        str(tmp_path / "r.json"), str(script)], capture_output=True, text=True, cwd=ROOT, env=env,
                       timeout=300)
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["verdict"] == "culprit" and res["culprits"] == ["head"], p.stdout + p.stderr
    # no autocast in a pure .half() model: the plain-PyTorch fix casts the module and its input
    plain = [a for a in res["advice"] if a.startswith("Plain PyTorch")]
    assert plain and all(".float()" in a and "autocast(" not in a for a in plain), res["advice"]


def test_live_report_is_not_called_killed_and_counts_optimizer_steps(tmp_path):
    # `print(w.report())` inside the training script, before remove(): the run is alive, not killed,
    # and its optimizer steps so far are known from the timeline (the meta gets them only at close)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    w = ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite"))
    try:
        for _ in range(3):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        d = w.report().diagnosis
        assert d.optimizer_steps == 3
        assert not any("killed" in line for line in d.lines), d.lines
        assert any("still in progress" in line for line in d.lines), d.lines
    finally:
        w.remove()
    d = w.report().diagnosis
    assert d.optimizer_steps == 3 and not any("progress" in line or "killed" in line for line in d.lines)


def test_a_later_forward_nan_from_broken_weights_is_not_the_first_producer(tmp_path):
    # fp16 autocast without a GradScaler and a badly weighted loss: the gradient entering the model from
    # the loss overflows at step 0 (the forward is finite), SGD writes NaN into the weights, and every
    # forward from step 1 on is NaN. The first non-finite value is that step-0 gradient, not the step-1
    # output of the first layer "from finite inputs" (its weights were not finite), and keeping that
    # layer in FP32 is not the fix.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite")) as w:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(torch.randn(32, 16))
            loss = out.float().mean() * 3e6
            opt.zero_grad()
            loss.backward()
            opt.step()
    rep = w.report()
    fn = rep.diagnosis.first_nonfinite
    assert fn["step"] == 0 and fn["layer"] == "4" and fn.get("from_loss"), fn
    assert not any("keep_fp32(model[0])" in a for a in rep.advice), rep.advice


def test_grad_scaler_subclasses_with_their_own_scale_and_update(tmp_path):
    # FSDP's ShardedGradScaler defines scale() and update() without calling GradScaler's: its scaled
    # loss (x 65536) was taken for the loss, with no scale and no skipped steps. A subclass that does
    # call the base class's methods must still make one step per update().
    from collections import defaultdict

    from torch.amp.grad_scaler import _refresh_per_optimizer_state

    class OwnScaler(torch.amp.GradScaler):  # like ShardedGradScaler: never calls the base class's
        def scale(self, outputs):
            if self._scale is None:
                self._lazy_init_scale_growth_tracker(outputs.device)
            return outputs * self._scale.to(outputs.dtype)

        def update(self, new_scale=None):  # a constant scale
            self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    class SuperScaler(torch.amp.GradScaler):
        def scale(self, outputs):
            return super().scale(outputs)

        def update(self, new_scale=None):
            super().update(new_scale)

    for cls in (OwnScaler, SuperScaler):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        scaler = cls("cpu", init_scale=1024.0)
        path = tmp_path / f"{cls.__name__}.sqlite"
        losses = []
        with ampdoctor.watch(model, trace=str(path)):
            for _ in range(3):
                loss = model(torch.randn(2, 4)).pow(2).mean()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                losses.append(loss.item())
        steps = TraceReader(path).steps()
        assert [s["step"] for s in steps] == [0, 1, 2], (cls.__name__, steps)
        assert [s["loss"] for s in steps] == pytest.approx(losses), cls.__name__
        assert all(s["scale"] == 1024.0 and s["skipped"] == 0 for s in steps), (cls.__name__, steps)
        # and their methods are their own again
        assert not hasattr(cls.__dict__["scale"], "__wrapped__") and not hasattr(cls.__dict__["update"], "__wrapped__")


def _scaler_patch_state() -> dict:
    """What the watch patches on GradScaler classes: every class's own scale/update/__init_subclass__."""
    state, todo = {}, [torch.amp.GradScaler]
    while todo:
        cls = todo.pop()
        todo.extend(type.__subclasses__(cls))
        state[cls] = {k: vars(cls).get(k) for k in ("scale", "update", "__init_subclass__")}
    return state


def test_grad_scaler_subclass_defined_after_watch_is_tracked_and_unpatched_after_remove(tmp_path):
    # a GradScaler subclass defined (or imported, like FSDP's ShardedGradScaler) after watch() was not
    # wrapped: with its own scale()/update() its scaled loss was taken for the loss, with no scale
    from collections import defaultdict

    from torch.amp.grad_scaler import _refresh_per_optimizer_state

    def own_scale(self, outputs):  # never calls GradScaler's
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(outputs.device)
        return outputs * self._scale.to(outputs.dtype)

    def own_update(self, new_scale=None):  # a constant scale
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    def super_scale(self, outputs):
        return torch.amp.GradScaler.scale(self, outputs)

    def super_update(self, new_scale=None):
        torch.amp.GradScaler.update(self, new_scale)

    def define(name, scale, update):  # class name(torch.amp.GradScaler): scale = ...; update = ...
        return type(name, (torch.amp.GradScaler,), {"scale": scale, "update": update})

    def train(scale, update, path=None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        w = ampdoctor.watch(model, trace=str(path)) if path else None
        cls = define("LateScaler", scale, update)  # after watch()
        scaler = cls("cpu", init_scale=1024.0)
        losses, scales = [], []
        for step in range(4):
            x = torch.randn(2, 4)
            if step == 1:
                x[0, 0] = 1e30  # an Inf loss: a skipped step, and GradScaler's update halves the scale
            loss = model(x).pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            losses.append(loss.item())
            scales.append(scaler.get_scale())
        if w is not None:
            w.remove()
        return cls, losses, scales

    before = _scaler_patch_state()
    for scale, update in ((own_scale, own_update), (super_scale, super_update)):
        _, ref_losses, ref_scales = train(scale, update)  # the reference: the same run unwatched
        path = tmp_path / f"{scale.__name__}.sqlite"
        late, losses, scales = train(scale, update, path)
        assert losses[1] == math.inf and (losses, scales) == (ref_losses, ref_scales)
        steps = TraceReader(path).steps()
        assert [s["step"] for s in steps] == [0, 1, 2, 3]
        assert [s["loss"] for s in steps] == losses  # not the scaled loss (x 1024)
        assert [s["scale"] for s in steps] == scales
        assert [s["skipped"] for s in steps] == [int(b < a) for a, b in zip([1024.0, *scales], scales)]
        # the process is as it was: no class keeps a patch, the late class has its own methods again
        assert vars(late)["scale"] is scale and vars(late)["update"] is update
        assert "__init_subclass__" not in vars(torch.amp.GradScaler)
        assert {c: v for c, v in _scaler_patch_state().items() if c in before} == before
        after = define("AfterRemove", scale, update)  # and a class made after remove() is left alone
        assert vars(after)["scale"] is scale and vars(after)["update"] is update
    assert scales == [1024.0, 512.0, 512.0, 512.0]  # GradScaler's own update ran: it skipped step 1


def test_gradient_calls_count_the_calls_that_had_a_gradient(tmp_path):
    # a sanity-check loop under no_grad before the first training step is evaluation (a training call
    # follows it in the step): it is not recorded, so the training forward is call 0 of every layer and
    # its one backward one gradient per layer (it was recorded as calls 0-19, the forward shown "x21");
    # the same loop once training has started is evaluation too
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    def validate():
        with torch.no_grad():
            for _ in range(20):
                model(torch.randn(4, 8))

    with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite")) as w:
        validate()
        step()
        validate()
        step()
    rep = w.report()
    assert {r.calls for r in rep.rows("activation")} == {1}
    assert {r.calls for r in rep.rows("gradient")} == {1}
    assert {r.calls for r in rep.rows("weight_grad")} == {1}
    steps = {s["step"]: s["call"] for s in TraceReader(tmp_path / "t.sqlite").stats(kind="activation")}
    assert steps == {0: 0, 1: 0}  # the largest call index per step


BUILT_BY_RUNNING_A_PART = '''
import torch
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.MaxPool2d(2))
        with torch.no_grad():  # the usual way to size the next layer
            n = self.features(torch.zeros(1, 3, 10, 10)).numel()
        self.fc = spectral_norm(nn.Linear(n, 5))  # evaluates its parametrization once, here

    def forward(self, x):
        return self.fc(torch.flatten(self.features(x), 1))

model = Net()
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
for step in range(2):
    model(torch.randn(2, 3, 10, 10)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
'''


def test_auto_watch_takes_the_model_not_a_part_run_while_it_is_built(tmp_path):
    # running `self.features` inside Net.__init__ (or spectral_norm's parametrization) made that part
    # "the model": names 0, 1, 2 instead of features.0, ..., the real model second as Net:..., and the
    # feature layers recorded twice
    p, out = _run_script(tmp_path, "cnn.py", BUILT_BY_RUNNING_A_PART)
    assert p.returncode == 0, p.stderr
    r = TraceReader(out / "trace.sqlite")
    names = {lay["id"]: lay["name"] for lay in r.layers()}
    recorded = {names[s["layer"]] for s in r.stats(kind="activation")}
    assert {"features.0", "features.1", "features.2", "fc"} <= recorded, recorded
    assert not any(":" in n for n in names.values()) and "0" not in recorded, sorted(names.values())


DIES = '''
import sys, torch, torch.nn as nn, ampdoctor
m = nn.Linear(4, 4)
ampdoctor.watch(m, trace=sys.argv[1])
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for step in range(3):
    m(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
if sys.argv[2] == "int":
    raise KeyboardInterrupt
if sys.argv[2] == "raise":
    raise RuntimeError("boom")
if sys.argv[2] == "exit7":
    sys.exit(7)
if sys.argv[2] == "exitmsg":
    sys.exit("bad config")
if sys.argv[2] == "exit0":
    sys.exit(0)
if sys.argv[2] == "caught":  # a SystemExit caught, then more training: the run ends normally
    try:
        sys.exit(4)
    except SystemExit:
        pass
    m(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
'''


@pytest.mark.parametrize("how, status, code", [("raise", "crashed", 1), ("int", "interrupted", 1), ("ok", "finished", 0),
                                               ("exit7", "exited", 7), ("exitmsg", "exited", 1), ("exit0", "finished", 0),
                                               ("caught", "finished", 0)])
def test_a_watched_script_that_dies_is_not_recorded_as_finished(tmp_path, how, status, code):
    # a script calling watch() itself (no `ampdoctor run`), never removing it: the trace says how it ended
    script = tmp_path / "dies.py"
    script.write_text(DIES)
    trace = tmp_path / "t.sqlite"
    p = subprocess.run([sys.executable, str(script), str(trace), how], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert p.returncode == (code if how != "int" else p.returncode) and (p.returncode != 0) == (code != 0), p.stderr
    meta = TraceReader(trace).meta()
    assert meta["status"] == status and len(TraceReader(trace).steps()) == (4 if how == "caught" else 3), meta
    if status == "exited":  # sys.exit(7), sys.exit("message"): the report says the script's status
        assert meta["exit_code"] == code, meta
        assert any(f"The script exited with status {code}" in line for line in build_report(trace).diagnosis.lines)
    if how == "raise":
        assert "RuntimeError: boom" in meta["error"]
        assert any("The script raised" in line for line in build_report(trace).diagnosis.lines)


def test_report_of_a_run_going_on_in_another_process_is_not_called_killed(tmp_path):
    # `ampdoctor report` of a trace that a live training process on this machine is writing: in
    # progress; once that process is killed: did not finish
    trace = tmp_path / "t.sqlite"
    code = ("import sys, torch, ampdoctor\nfrom torch import nn\nm = nn.Linear(4, 1)\n"
            "opt = torch.optim.SGD(m.parameters(), lr=0.1)\nw = ampdoctor.watch(m, trace=sys.argv[1])\n"
            "for _ in range(2):\n    m(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()\n"
            "print('ready', flush=True)\nsys.stdin.read()\n")
    p = subprocess.Popen([sys.executable, "-c", code, str(trace)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        for _ in range(100):  # the writer process commits what it was sent
            try:
                if len(TraceReader(trace).steps()) == 2:
                    break
            except Exception:
                pass
            time.sleep(0.1)
        lines = build_report(trace).diagnosis.lines
        assert any("still in progress" in line for line in lines) and not any("killed" in line for line in lines), lines
    finally:
        p.kill()
        p.wait()
    lines = build_report(trace).diagnosis.lines
    assert any("did not finish (killed?)" in line for line in lines), lines


@pytest.mark.cuda
def test_hf_trainer_fp16_run_names_the_layer_and_the_all_fp32_control_passes(tmp_path):
    """HF ``Trainer(fp16=True)`` (through accelerate, which enters autocast inside ``model.forward``):
    ``run`` names the planted layer, and bisect's all-FP32 control passes (it ran in fp16 before, so the
    verdict was not_precision)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from ampdoctor.bisect.trials import TrialRunner

    script = ROOT / "tests" / "scripts" / "hf_trainer.py"
    env = dict(os.environ)
    env.pop("AMPDOCTOR_CONFIG", None)
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "ampdoctor", "run", "--out", str(out), str(script), "--", "--break",
                        "--steps", "6", "--out", str(tmp_path / "hf")],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    fn = report["diagnosis"]["first_nonfinite"]
    assert fn["layer"] == "bert.encoder.layer.2.intermediate.dense" and fn["kind"] == "activation" and fn["step"] == 0
    runner = TrialRunner(str(script), ["--break", "--steps", "12", "--out", str(tmp_path / "hf")], tmp_path / "b",
                         oracle={}, timeout=600)
    assert runner.run("all-fp32", [""], pass_after=5).outcome == "pass"
    assert runner.run("baseline", [], pass_after=5).outcome == "fail"


def test_auto_watch_hides_torchs_compiled_module_warning_and_puts_the_filters_back(tmp_path):
    """Under ``ampdoctor run`` torch warned at the calls of a ``torch.compile``'d model that "global
    hooks" fire an extra time: the hook is ampdoctor's automatic watch, which handles the wrapper."""
    import warnings

    from ampdoctor.autowatch import AutoWatch
    from ampdoctor.config import RunConfig
    from ampdoctor.session import Session

    session = Session(RunConfig(trace=str(tmp_path / "t.sqlite")), owned=True)
    before = list(warnings.filters)
    auto = AutoWatch(session)
    try:
        with warnings.catch_warnings(record=True) as got:
            warnings.warn("Using `torch.compile(module)` when there are global hooks on modules (e.g., from "
                          "`register_module_forward_hook`); this will cause the hooks to fire an extra time", UserWarning, stacklevel=1)
            warnings.warn("a warning of the user's own", UserWarning, stacklevel=1)
        assert [str(w.message) for w in got] == ["a warning of the user's own"]
    finally:
        auto.remove()
        session.close()
    assert warnings.filters == before


def test_gan_two_optimizers_one_scaler_partial_skips_are_said(tmp_path):
    # a GAN's D overflows fp16 at every step while G's steps go through: the GradScaler's scale falls
    # every step ("skipped"), but an optimizer still steps in most of them; the report says so instead
    # of implying that nothing was updated
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
    D = nn.Sequential(nn.Linear(16, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    og = torch.optim.SGD(G.parameters(), lr=1e-3)
    od = torch.optim.SGD(D.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    real = torch.randn(8, 16) * 1e3
    with ampdoctor.watch(D, trace=str(tmp_path / "t.sqlite")) as w:
        for _ in range(6):
            with torch.autocast("cpu", dtype=torch.float16):
                fake = G(torch.randn(8, 8))
                d_loss = (D(fake.detach()) - D(real * 100)).mean()  # D's real branch overflows: D skips
            od.zero_grad()
            scaler.scale(d_loss).backward()
            scaler.step(od)
            with torch.autocast("cpu", dtype=torch.float16):
                g_loss = -D(fake).mean()
            og.zero_grad()
            scaler.scale(g_loss).backward()
            scaler.step(og)
            scaler.update()
        rep = w.report()
    steps = TraceReader(tmp_path / "t.sqlite").steps()
    ran = [b["optimizer_steps"] - a["optimizer_steps"] for a, b in zip([{"optimizer_steps": 0}] + steps, steps)]
    partial = sum(1 for s, r in zip(steps, ran) if s["skipped"] and r > 0)
    assert partial > 0 and all(s["skipped"] for s in steps)
    line = next(x for x in rep.diagnosis.lines if x.startswith("GradScaler skipped"))
    assert f"in {partial} of them another optimizer still stepped" in line, line
