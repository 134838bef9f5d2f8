"""Audit (watch() on models it did not expect): TorchScript parts, a watch() that fails half-way, the
hook dicts of leaf tensors after remove(), and what remove() of one of two watches leaves readable."""

import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.trace import TraceReader


def _train(model, steps=2, x=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        model(torch.randn(2, 4) if x is None else x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _hook_counts(model):
    return {n: (len(m._forward_pre_hooks), len(m._forward_hooks)) for n, m in model.named_modules()
            if not isinstance(m, torch.jit.ScriptModule)}


def test_a_scripted_submodule_is_left_out_with_a_note_and_the_rest_recorded(tmp_path):
    # hooking it raised torch's "register_forward_pre_hook is not supported on ScriptModules" out of
    # watch(), and the modules hooked before it kept their hooks, with no handle to remove them
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))))
    before = _hook_counts(m)
    w = ampdoctor.watch(m, trace=tmp_path / "t.sqlite")
    _train(m)
    w.remove()
    assert _hook_counts(m) == before
    t = TraceReader(tmp_path / "t.sqlite")
    names = {r["name"] for r in t.layers()}
    assert {"0", "1"} <= names and not names & {"2", "2.0", "2.1"}
    assert {t.layers()[r["layer"]]["name"] for r in t.stats(kind="activation")} >= {"0", "1"}
    notes = [e["detail"]["message"] for e in t.events() if e["kind"] == "note"]
    assert any(n.startswith("2 (Sequential) is a TorchScript module (torch.jit.script or torch.jit.trace): hooks "
                            "cannot be put on it, so it and its submodules are not recorded") for n in notes), notes


def test_a_scripted_model_is_refused_with_what_to_do(tmp_path):
    m = torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    with pytest.raises(TypeError, match=r"cannot record a TorchScript model \(Sequential made by torch.jit.script "
                                        r"or torch.jit.trace\).*Watch the nn.Module itself, before scripting it"):
        ampdoctor.watch(m, trace=tmp_path / "a.sqlite")
    # nothing of it stays: the next watch records where it is told to
    other = nn.Linear(4, 1)
    w = ampdoctor.watch(other, trace=tmp_path / "b.sqlite")
    assert w.trace_path == tmp_path / "b.sqlite"
    _train(other)
    w.remove()
    assert len(TraceReader(tmp_path / "b.sqlite").steps()) == 2


def test_a_watch_that_fails_half_way_takes_its_hooks_and_session_back(tmp_path, monkeypatch):
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    before = _hook_counts(m)
    real = nn.Module.register_forward_hook
    seen = []

    def refuses_the_third(self, *a, **k):
        seen.append(self)
        if len(seen) == 3:
            raise RuntimeError("this module takes no hooks")
        return real(self, *a, **k)

    monkeypatch.setattr(nn.Module, "register_forward_hook", refuses_the_third)
    backward = torch.autograd.backward
    with pytest.raises(RuntimeError, match="this module takes no hooks"):
        ampdoctor.watch(m, trace=tmp_path / "a.sqlite")
    monkeypatch.undo()
    assert _hook_counts(m) == before
    assert torch.autograd.backward is backward
    w = ampdoctor.watch(m, trace=tmp_path / "b.sqlite")  # not "this process already records to a.sqlite"
    assert w.trace_path == tmp_path / "b.sqlite"
    w.remove()


def test_leaf_tensors_get_their_hook_dicts_back_after_remove(tmp_path):
    # a leaf the model reads (an input that requires grad; weight_norm's original0/original1) had
    # _backward_hooks None before the watch, and an empty OrderedDict after it
    torch.manual_seed(0)
    lin = nn.utils.parametrizations.weight_norm(nn.Linear(4, 4))
    m = nn.Sequential(lin, nn.ReLU(), nn.Linear(4, 1))
    x = torch.randn(2, 4, requires_grad=True)
    leaves = {"x": x, **dict(m.named_parameters())}
    before = {n: t._backward_hooks for n, t in leaves.items()}
    assert before["x"] is None
    mine = lambda g: g  # noqa: E731 - a hook of the user's own stays
    m[2].weight.register_hook(mine)
    before["2.weight"] = dict(m[2].weight._backward_hooks)
    w = ampdoctor.watch(m, trace=tmp_path / "t.sqlite")
    _train(m, x=x)
    w.remove()
    after = {n: t._backward_hooks for n, t in leaves.items()}
    assert after["x"] is None
    assert after["0.parametrizations.weight.original0"] is before["0.parametrizations.weight.original0"]
    assert dict(after["2.weight"]) == before["2.weight"]


def test_removing_one_of_two_watches_leaves_what_was_recorded_readable(tmp_path):
    a, b = nn.Linear(4, 1), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    wa = ampdoctor.watch(a, trace=tmp_path / "t.sqlite")
    wb = ampdoctor.watch(b)
    _train(b)
    wb.remove()
    t = TraceReader(tmp_path / "t.sqlite")  # at once, with the session still open for `a`
    assert len(t.steps()) == 2
    assert {t.layers()[r["layer"]]["name"] for r in t.stats(kind="activation")} >= {"Sequential:0", "Sequential:1"}
    wa.remove()


_SAMPLED = """
import sys, torch, ampdoctor
torch.set_num_threads(1); torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
w = ampdoctor.watch(model, every=4, trace=sys.argv[1])
for step in range(14):
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    if sys.argv[2] == "transient" and step == 5:
        x = x * 1e5  # one NaN loss (an fp16 overflow in layer 0), at a step not recorded in detail
    with torch.autocast("cpu", dtype=torch.float16):
        loss = ((model(x).float() - y) ** 2).mean()
    loss.backward()
    if sys.argv[2] == "update" and step == 5:
        with torch.no_grad():
            model[2].weight.grad[0, 0] = float("inf")  # the update makes layer 2's weights Inf; NaN spreads from there
    if sys.argv[2] == "update" or torch.isfinite(loss):
        opt.step()
    opt.zero_grad()
w.remove()
"""


def _sampled_report(tmp_path, how):
    import subprocess
    import sys

    from ampdoctor.report import build_report

    script = tmp_path / "sampled.py"
    script.write_text(_SAMPLED)
    p = subprocess.run([sys.executable, str(script), str(tmp_path / "t.sqlite"), how], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    return build_report(tmp_path / "t.sqlite")


def test_sampled_steps_do_not_blame_a_layer_that_nan_reached_through_the_updates(tmp_path):
    # with every=4 the loss went NaN at step 6 (after step 5's update); the first detailed step (7: on the
    # CPU step 6's loss is read where it ends) showed layer 0's output NaN (its weights were NaN by then)
    # and the advice said to keep layer 0 in FP32
    rep = _sampled_report(tmp_path, "update")
    text = " ".join(rep.diagnosis.lines)
    assert rep.diagnosis.first_nonfinite is None
    assert "The loss was non-finite from step 6 (layer statistics sampled every 4 steps): the first non-finite value " \
           "recorded (step 7," in text, text
    assert "Rerun with --every 1 to pin it" in text and "produced NaN/Inf from finite inputs" not in text
    assert not any("keep_fp32" in a for a in rep.advice), rep.advice


def test_a_nan_loss_at_a_step_not_recorded_in_detail_is_said(tmp_path):
    rep = _sampled_report(tmp_path, "transient")
    text = " ".join(rep.diagnosis.lines)
    assert "The loss was non-finite at step 5, which was not recorded in detail (layer statistics sampled every 4 " \
           "steps): rerun with --every 1" in text, text
    assert not any("see the first non-finite producer" in a for a in rep.advice), rep.advice
