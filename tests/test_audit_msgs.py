"""Notes and advice a user reads: the model itself named in a note, a backward() that raised, an
optimizer step with no gradients, and counts in the number their word takes ("1 step", not "1 steps")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from report_helpers import synthetic_trace
from torch import nn

import ampdoctor
from ampdoctor.report import build_report

ROOT = Path(__file__).resolve().parents[1]


class LossModel(nn.Module):
    """Returns its loss, as a Hugging Face model's ``outputs.loss``: the model's own output."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x, y):
        return (self.fc(x) - y).pow(2).mean()


def test_stale_root_output_note_names_the_model_in_plain_words(tmp_path):
    """The HF Trainer's ``loss *= num_processes`` changes the model's output in place, from a step after the
    first (once it counts the batch's items): that output goes stale before it is read. The note names the
    model (its layer name is "") and says what happened without the recorder's words."""
    torch.manual_seed(0)
    model = LossModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trace = tmp_path / "t.sqlite"
    with ampdoctor.watch(model, trace=str(trace)):
        for step in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(8, 4), torch.randn(8, 1))
            if step >= 1:
                loss *= 2.0
            loss.backward()
            opt.step()
            opt.zero_grad()
    notes = build_report(trace).notes
    assert notes == ["(model) LossModel: its output was changed in place (e.g. `loss *= n` or an in-place op on it) "
                     "before ampdoctor read it, so step 1 has no statistics or NaN/Inf check of it; from the next step "
                     "on it is read as soon as it is made. Nothing to fix in your code."], notes


class InPlaceInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)
        self.in_place = False

    def forward(self, x):
        h = self.fc(x)
        if self.in_place:
            h.mul_(2.0)
        return self.head(h)


def test_stale_layer_output_note_and_the_step_it_misses(tmp_path):
    """A layer's output changed in place from step 1 on: the note names the layer and step 1, and that step is
    the one its activation rows lack (2 of 3 steps)."""
    torch.manual_seed(0)
    model = InPlaceInside()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trace = tmp_path / "t.sqlite"
    with ampdoctor.watch(model, trace=str(trace)):
        for step in range(3):
            model.in_place = step >= 1
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    rep = build_report(trace)
    assert len(rep.notes) == 1 and rep.notes[0].startswith("fc: its output was changed in place"), rep.notes
    assert "step 1 has no statistics" in rep.notes[0]
    assert [r.steps for r in rep.rows("activation") if r.layer == "fc"] == [2]


class Explodes(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("custom backward exploded")


class WithCustomOp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 1)

    def forward(self, x):
        return self.fc2(Explodes.apply(self.fc(x)))




def test_backward_that_raises_is_said_and_gets_no_loss_scale_advice(tmp_path):
    """loss.backward() raises in a custom Function's backward every step (the script catches it): no optimizer
    step runs. The report says backward raised and with what, and gives no loss scale for the half-made
    gradients (they were scaled by 65536, with no update() to say so: the old advice was init_scale=2**-12)."""
    torch.manual_seed(0)
    model = WithCustomOp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    trace = tmp_path / "t.sqlite"
    raised = 0
    with ampdoctor.watch(model, trace=str(trace)):
        for _ in range(2):
            try:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(torch.randn(8, 4)).float().pow(2).mean()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            except RuntimeError as e:
                assert str(e) == "custom backward exploded"  # the user's error, unchanged
                raised += 1
    assert raised == 2
    rep = build_report(trace)
    assert rep.diagnosis.optimizer_steps == 0
    assert rep.meta["backward_error"] == "RuntimeError: custom backward exploded"
    assert rep.meta["backward_error_step"] == 0
    assert [n for n in rep.notes if "backward() raised" in n] == [
        "backward() raised at step 0: RuntimeError: custom backward exploded. The gradients recorded for that step "
        "are partial (the backward pass stopped where it raised); this is an error in the code the backward pass "
        "ran, not a numerical one."]
    assert rep.advice == ["Fix the error that backward() raised at step 0 first (RuntimeError: custom backward "
                          "exploded): the gradients of that step stop where it raised, so the numbers recorded for "
                          "them are partial."], rep.advice


def test_hand_written_update_keeps_its_loss_scale_advice(tmp_path):
    """No optimizer step either, but backward() ran in full (weights updated by hand): the advice stays."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    trace = tmp_path / "t.sqlite"
    with ampdoctor.watch(model, trace=str(trace)):
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(8, 4)).float().pow(2).mean()
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
    rep = build_report(trace)
    assert rep.diagnosis.optimizer_steps == 0 and "backward_error" not in rep.meta
    assert any(a.startswith("Loss scale: ") for a in rep.advice), rep.advice


SCRIPT = f"""
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
import torch, ampdoctor
from test_audit_msgs import WithCustomOp

torch.manual_seed(0)
model = WithCustomOp()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
ampdoctor.watch(model)
for _ in range(3):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(8, 4)).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
"""


def test_cli_run_of_a_script_whose_backward_raises(tmp_path):
    """`ampdoctor run` on a script whose first backward raises: the report says so, with no note about
    "weight gradients that no backward() made" and no GradScaler init_scale advice (0 optimizer steps)."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("AMPDOCTOR_CONFIG", None)
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "ampdoctor", "run", "--out", str(out), str(script)], capture_output=True,
                       text=True, cwd=ROOT, env=env, timeout=120)
    assert p.returncode != 0
    report = json.loads((out / "report.json").read_text())
    assert report["diagnosis"]["optimizer_steps"] == 0
    assert not any("no backward() made" in n for n in report["notes"]), report["notes"]
    assert any(n.startswith("backward() raised at step 0: RuntimeError: custom backward exploded") for n in report["notes"])
    assert not any("init_scale" in a or a.startswith("Loss scale") for a in report["advice"]), report["advice"]
    assert report["advice"][0].startswith("Fix the error that backward() raised at step 0 first")
    assert "Fix the error that backward() raised" in p.stdout


def _step_without_grads(tmp_path, order):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    trace = tmp_path / f"{order}.sqlite"
    with ampdoctor.watch(model, trace=str(trace)):
        for _ in range(3):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            if order == "no_backward":
                opt.step()
            elif order == "zero_grad_between":
                loss.backward()
                opt.zero_grad()
                opt.step()
            else:
                opt.zero_grad()
                loss.backward()
                opt.step()
    changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return build_report(trace).notes, changed


NO_GRAD_NOTE = ("Adam.step() ran at step 0 while none of its parameters had a gradient, so it changed no weight. "
                "Did loss.backward() run before it? A zero_grad() between backward() and step() clears the gradients "
                "too: call it before backward() or after step().")


def test_optimizer_step_without_gradients_is_noted_once(tmp_path):
    for order in ("no_backward", "zero_grad_between"):
        notes, changed = _step_without_grads(tmp_path, order)
        assert not changed  # (what the note says: the weights did not move)
        assert notes == [NO_GRAD_NOTE], (order, notes)
    notes, changed = _step_without_grads(tmp_path, "right")
    assert changed and notes == []


def test_plural():
    from ampdoctor.report.phrasing import plural

    assert [plural(n, "step") for n in (0, 1, 2)] == ["0 steps", "1 step", "2 steps"]
    assert plural(1, "start-up backoff") == "1 start-up backoff"
    assert plural(3, "matrix", "matrices") == "3 matrices"


def test_report_counts_take_the_singular_for_one(tmp_path):
    """One step, one optimizer step, one value: the header and the loss-scale advice say "1 step" (the text
    report and the HTML), never "1 steps"; a GradScaler's single start-up backoff "is normal"."""
    p = synthetic_trace(tmp_path / "one.sqlite", grad_exps=[(-10, 1)], scales=[2.0 ** 10])
    rep = build_report(p)
    text = rep.to_text(width=400)
    assert "; 1 step, 1 optimizer step" in text, text
    assert "(1 value over 1 step, unscaled)" in text, text
    assert "1 values" not in text and "over 1 steps" not in text and "1 optimizer steps" not in text
    from ampdoctor.report.html import render_html

    html = render_html(rep)
    assert "1 step, 1 optimizer step" in html and "1 optimizer steps" not in html
    assert "did not break</span>1 step seen" in html
    # one backoff (the first step skipped, its scale halved), then steps taken
    p = synthetic_trace(tmp_path / "backoff.sqlite", grad_exps=[(-10, 1000)], scales=[2.0 ** 15] + [2.0 ** 15] * 5,
                        skipped=[1, 0, 0, 0, 0, 0])
    advice = build_report(p).advice
    assert any("1 start-up backoff (" in a and ") is normal" in a for a in advice), advice
    assert not any("1 start-up backoffs" in a for a in advice)


def test_zero_gradient_advice_over_one_recorded_step(tmp_path):
    """Every fp16 gradient exactly 0 in the only recorded step: "in the one recorded step", not "in all 1
    recorded steps"."""
    import numpy as np

    from ampdoctor.formats import get_format
    from ampdoctor.trace import TraceWriter, hist_blob

    f = get_format("fp16")
    w = TraceWriter(tmp_path / "t.sqlite")
    w.set_meta(format="fp16", every=1, status="finished", argv=["synthetic"])
    w.add_layers([(0, "lin", "Linear", 0, 1, None)])
    act = np.zeros(f.n_bins, dtype=np.int64)
    act[1 - f.min_exp] = 10
    w.add_stats([(0, 0, "activation", "out", 0, "float16", 10, 20, 0, 0, 0, 0, -1.5, 1.5, 1.5, 1.0, 0, 0, 0,
                  hist_blob(act)),
                 (0, 0, "gradient", "out", 0, "float16", 10, 20, 0, 0, 0, 10, 0.0, 0.0, 0.0, 0.0, 0, 0, 0,
                  hist_blob(np.zeros(f.n_bins, dtype=np.int64)))])  # ten values, all 0
    w.add_step((0, 1.0, None, None, 1, 1, 0.0))
    w.commit()
    w.close()
    advice = build_report(tmp_path / "t.sqlite").advice
    line = next((a for a in advice if a.startswith("Every fp16 activation gradient (lin) was exactly 0")), None)
    assert line is not None, advice
    assert "exactly 0 in the one recorded step while the loss was finite" in line and "all 1" not in line


def test_a_one_step_healthy_run_says_step_not_steps(tmp_path):
    """The diagnosis of a run of one healthy step: "in the 1 step seen" (it said "1 steps")."""
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    path = tmp_path / "t.sqlite"
    with ampdoctor.watch(m, trace=str(path)):
        m(torch.randn(3, 4)).square().mean().backward()
        opt.step()
    lines = build_report(path).diagnosis.lines
    assert "Training did not break in the 1 step seen." in lines, lines


def test_fp32_gradients_exactly_zero_are_not_called_an_fp16_underflow(tmp_path):
    """An FP32 run (measured against fp16) whose loss does not depend on the output: every gradient is
    exactly 0 in float32. Nothing underflowed and no loss scale lifts a 0; the advice said the fp16
    gradients underflowed and asked for a scale of at least 2**11."""
    import torch

    import ampdoctor

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with ampdoctor.watch(m, format="fp16", trace=str(tmp_path / "t.sqlite")) as w:
        for _ in range(3):
            loss = 0.0 * m(torch.randn(2, 4)).sum() + 1.0
            loss.backward()
            opt.step()
            opt.zero_grad()
        advice = w.report().advice
    line = next((a for a in advice if "was exactly 0" in a), None)
    assert line is not None, advice
    assert line.startswith("Every activation gradient (1, 0) was exactly 0 in float32 in all 3 recorded steps")
    assert "nothing underflowed" in line and "No loss scale changes that" in line
    assert not any("underflow to zero" in a or "2**11" in a for a in advice), advice


class _VAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU())
        self.fc_mu, self.fc_logvar = nn.Linear(128, 16), nn.Linear(128, 16)
        self.dec = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 32))
        nn.init.normal_(self.fc_logvar.weight, std=0.8)  # logvar about +-20: exp(logvar) past 65504

    def forward(self, x):
        h = self.enc(x)
        mu, logvar = self.fc_mu(h), self.fc_logvar(h)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar.clamp(max=10))
        return self.dec(z), mu, logvar


def test_a_loss_that_is_inf_in_forward_is_the_first_nonfinite_not_a_scaled_weight_gradient(tmp_path):
    """A VAE whose KL term's logvar.exp() overflows fp16 from step 0: the loss is Inf in forward, every layer's
    output finite. The decoder's weight gradient (backward runs it first) was named the first non-finite value,
    'produced from finite inputs', and bisect named it too; the loss comes first, in forward."""
    import ampdoctor
    from ampdoctor.bisect.candidates import read_baseline
    from ampdoctor.report import build_report

    torch.manual_seed(0)
    model = _VAE()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.tanh(torch.randn(64, 8) @ torch.randn(8, 32)) * 3
    with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite")):
        for _ in range(4):
            with torch.autocast("cpu", dtype=torch.float16):
                recon, mu, logvar = model(x)
                kl = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp()) / 64
                loss = torch.nn.functional.mse_loss(recon, x, reduction="sum") / 64 + kl
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    rep = build_report(tmp_path / "t.sqlite")
    fn = rep.diagnosis.first_nonfinite
    assert fn["step"] == 0 and fn.get("loss_nonfinite") and fn["kind"] == "gradient", fn
    lines = "\n".join(rep.diagnosis.lines)
    assert "First non-finite value: step 0, the loss itself, while every watched layer's output was finite" in lines, lines
    assert "produced NaN/Inf from finite inputs" not in lines
    assert rep.advice[0].startswith("The loss itself was non-finite at step 0"), rep.advice
    bl = read_baseline(tmp_path / "t.sqlite", 0, "nonfinite_loss")
    assert bl.first_nonfinite.get("loss_nonfinite") and bl.first_nonfinite["step"] == 0, bl.first_nonfinite
