"""watch(): what it records, that it leaves the process exactly as it was, awkward models."""

import collections
import functools
import json
import math

import pytest
import torch
import torch.optim.optimizer as optim_mod
from helpers import Attn, SquareNorm, train
from torch import nn
from torch.nn.modules import module as module_mod

import ampdoctor
from ampdoctor import session as session_mod
from ampdoctor.trace import TraceReader


def _global_state():
    gs = [torch.amp.GradScaler.__dict__.get(k) for k in ("scale", "update", "step", "unscale_", "__init_subclass__")]
    return (torch.autograd.backward, tuple(gs), dict(module_mod._global_forward_hooks),
            dict(module_mod._global_forward_pre_hooks), dict(optim_mod._global_optimizer_post_hooks))


def _module_state(model):
    out = []
    for name, m in model.named_modules():
        out.append((name, dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m._backward_hooks),
                    sorted(vars(m).keys())))
    for name, p in model.named_parameters():
        out.append((name, p.dtype, getattr(p, "_post_accumulate_grad_hooks", None), p._backward_hooks))
    return out


def _model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 1))


def test_remove_restores_everything(tmp_path):
    model = _model()
    before_g, before_m = _global_state(), _module_state(model)
    ref = model(torch.ones(2, 8)).detach()
    w = ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite"))
    assert _global_state() != before_g  # something was installed
    train(model, 2)
    w.remove()
    w.remove()  # idempotent
    assert _global_state() == before_g
    assert _module_state(model) == before_m
    with torch.no_grad():
        model2 = _model()
        model2.load_state_dict(model.state_dict())
    assert model(torch.ones(2, 8)).dtype == ref.dtype


@pytest.mark.parametrize("how", ["mock", "by hand"])
def test_a_patch_laid_over_ours_after_watch_is_kept_and_ours_leaves_when_it_ends(tmp_path, how):
    """A spy on torch.autograd.backward set after watch() (mock.patch, a profiler) and a remove() inside it:
    remove() put its own saved original back, dropping the user's spy, and when the spy ended it put
    ampdoctor's wrapper back for good. Now the spy stays, and ours, under it, calls the original and
    leaves at its first call once it is back on top."""
    from unittest import mock
    model = _model()
    orig, orig_step = torch.autograd.backward, torch.amp.GradScaler.__dict__["step"]
    w = ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite"))
    ours = torch.autograd.backward
    calls = []
    if how == "mock":
        spy = mock.patch("torch.autograd.backward", wraps=ours)
        start, stop = spy.start, spy.stop
    else:
        def spied(*a, **k):
            calls.append(1)
            return ours(*a, **k)

        def start():
            torch.autograd.backward = spied
            return spied

        def stop():
            torch.autograd.backward = ours
    installed = start()
    train(model, 1)
    w.remove()
    assert torch.autograd.backward is installed  # the user's patch is theirs to end
    assert torch.amp.GradScaler.__dict__["step"] is orig_step  # (the others were on top: put back at once)
    train(model, 1)  # through their patch, to ours: the original, nothing recorded
    stop()
    assert torch.autograd.backward is ours  # their patch put ours back...
    train(model, 1)
    assert torch.autograd.backward is orig  # ...which left at its first call
    assert TraceReader(tmp_path / "t.sqlite").meta()["steps"] == 1
    assert (installed.call_count if how == "mock" else len(calls)) == 2


def test_a_loss_and_output_kept_past_remove_keep_neither_the_watch_nor_its_session(tmp_path):
    """A loss (or the model's output) kept past remove() without .detach() (a list of losses, a retained
    graph) kept the Watch and its Session alive through the gradient hooks on it; their hooks, which do
    nothing once the watch is removed, now hold them weakly."""
    import gc
    import weakref
    model = _model()
    w = ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite"))
    out = model(torch.randn(4, 8))
    loss = out.pow(2).mean()
    loss.backward(retain_graph=True)
    w.remove()
    refs = weakref.ref(w), weakref.ref(w.session)
    assert loss._backward_hooks and out._backward_hooks  # (non-leaf tensors: see the README's limits)
    del w
    gc.collect()
    assert [r() for r in refs] == [None, None]
    model.zero_grad()
    loss.backward()  # the hooks left on the kept tensors do nothing
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_context_manager_and_records_everything(tmp_path):
    model = _model()
    with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite")) as w:
        losses = train(model, 3)
    assert w._removed
    r = TraceReader(tmp_path / "t.sqlite")
    steps = r.steps()
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert [round(s["loss"], 4) for s in steps] == [round(v, 4) for v in losses]
    assert all(s["scale"] is not None for s in steps)
    kinds = {s["kind"] for s in r.stats()}
    assert kinds == {"activation", "gradient", "weight", "weight_grad"}
    names = {lay["id"]: lay["name"] for lay in r.layers()}
    act_layers = {names[s["layer"]] for s in r.stats(kind="activation")}
    assert act_layers == {"0", "1", "2", "3", "4"}  # leaves only by default
    lin = [s for s in r.stats(kind="activation") if names[s["layer"]] == "0"]
    assert lin[0]["dtype"] == "float16" and lin[0]["numel"] == 4 * 16 and lin[0]["bytes"] == 4 * 16 * 2
    assert r.meta()["status"] == "finished"


def test_loss_without_scaler_and_every(tmp_path):
    model = _model()
    with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite"), every=2):
        losses = train(model, 5, scaler=False)
    r = TraceReader(tmp_path / "t.sqlite")
    steps = r.steps()
    assert [round(s["loss"], 4) for s in steps] == [round(v, 4) for v in losses]
    assert [s["recorded"] for s in steps] == [1, 0, 1, 0, 1]
    assert {s["step"] for s in r.stats()} == {0, 2, 4}
    assert all(s["scale"] is None for s in steps)


def test_hooks_sleep_on_steps_not_recorded(tmp_path):
    """every=3: between recorded steps the module and weight-gradient hooks are out of their dicts
    (PyTorch's fast call path); they come back in their places, after a user's earlier hook and
    before a later one; remove() while they sleep restores everything."""
    model = _model()
    before_m = _module_state(model)
    calls: list = []
    early = model[2].register_forward_hook(lambda m, a, o: calls.append("early"))
    w = ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite"), every=3)
    late = model[2].register_forward_hook(lambda m, a, o: calls.append("late"))
    ours = [k for k in model[2]._forward_hooks if k not in (early.id, late.id)]
    assert list(model[2]._forward_hooks) == [early.id, *ours, late.id]
    seen = []
    for _ in range(5):
        seen.append((len(model[1]._forward_pre_hooks), len(model[0]._forward_pre_hooks),
                     model[0].weight._post_accumulate_grad_hooks, list(model[2]._forward_hooks)))
        train(model, 1)
    # model[1] (ReLU(inplace=True)) keeps its pre-hook, asleep between recorded steps; model[0] (a
    # leaf that changes no input) loses its pre-hook after the first recorded step
    assert [s[:3] for s in seen] == [(1, 1, None), (0, 0, None), (0, 0, None), (1, 0, None), (0, 0, None)]
    assert seen[3][3] == [early.id, *ours, late.id] and seen[1][3] == [early.id, late.id]
    assert calls.count("early") == calls.count("late") == 5
    w.remove()
    early.remove()
    late.remove()
    assert _module_state(model) == before_m
    r = TraceReader(tmp_path / "t.sqlite")
    assert [s["recorded"] for s in r.steps()] == [1, 0, 0, 1, 0]
    assert {s["step"] for s in r.stats(kind="activation")} == {0, 3}
    assert {s["step"] for s in r.stats(kind="weight_grad")} == {0, 3}


def _inf_at_step_5(tmp_path, steps: int) -> set:
    """every=4, an Inf input (so a NaN loss) at step 5: the steps marked recorded, after checking
    that exactly those have statistics (the hooks were back for each of them)."""
    torch.manual_seed(0)
    model = _model()

    def make_x(i):
        x = torch.randn(4, 8)
        if i == 5:
            x[0, 0] = float("inf")
        return x

    with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite"), every=4):
        train(model, steps, make_x=make_x, scaler=False, autocast=False, lr=0.0)
    r = TraceReader(tmp_path / "t.sqlite")
    recorded = {s["step"] for s in r.steps() if s["recorded"]}
    for kind in ("activation", "gradient", "weight_grad"):
        assert {s["step"] for s in r.stats(kind=kind)} == recorded
    return recorded


@pytest.fixture
def deferred_read(monkeypatch):
    """The host read deferred as on CUDA (HostCopy says it went to a GPU), on the CPU."""
    from ampdoctor import hostcopy
    start = hostcopy.HostCopy.start

    def start_as_cuda(self):
        start(self)
        self.on_cuda = True

    monkeypatch.setattr(hostcopy.HostCopy, "start", start_as_cuda)
    monkeypatch.setattr(hostcopy.HostCopy, "defers", staticmethod(lambda devices: True))
    monkeypatch.setattr(session_mod, "_on_host", lambda scalars: False)  # (the losses "on the GPU": not read at once)


def test_detail_after_a_nonfinite_loss_wakes_the_hooks(tmp_path):
    """every=4 and a NaN loss at step 5 (on the CPU read where step 5 ends): the steps recorded in
    detail after it have their statistics, so the hooks were back for them, and no step that is not
    marked recorded has any. (The NaN reaches the weights: every later loss is NaN, and detailed.)"""
    recorded = _inf_at_step_5(tmp_path, 12)
    assert {0, 4, 6, 7, 8} <= recorded and not {1, 2, 3, 5} & recorded


def test_model_compiled_after_watch_records_the_same_without_recompiling(tmp_path):
    """watch(model) and then torch.compile(model): the hooks run outside the traced graph (dynamo
    would otherwise guard on the session's state and recompile every step), and the trace holds
    the same statistics as without compile."""
    from torch._dynamo.utils import counters

    def record(name, compiled):
        torch.manual_seed(0)
        model = _model()
        with ampdoctor.watch(model, trace=str(tmp_path / f"{name}.sqlite"), every=2):
            torch.manual_seed(1)
            train(torch.compile(model, backend="eager") if compiled else model, 8)
        r = TraceReader(tmp_path / f"{name}.sqlite")
        return [(s["step"], s["layer"], s["kind"], s["slot"], s["min"], s["max"], s["nan"]) for s in r.stats()]

    torch._dynamo.reset()
    counters.clear()
    got = record("compiled", True)
    frames = counters["frames"]["total"]
    torch._dynamo.reset()
    assert frames <= 20  # about 16 here; 83 when the hooks were traced (a recompile a step and more)
    assert sorted(got) == sorted(record("eager", False)) and got


def test_inplace_relu_after_linear_records_pre_relu_values(tmp_path):
    torch.manual_seed(0)
    lin = nn.Linear(8, 16)
    model = nn.Sequential(lin, nn.ReLU(inplace=True))
    x = torch.randn(4, 8)
    expected_min = lin(x).min().item()
    assert expected_min < 0
    with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite")):
        train(model, 1, make_x=lambda i: x, autocast=False)
    r = TraceReader(tmp_path / "t.sqlite")
    rows = r.stats(kind="activation")
    assert rows[0]["min"] == pytest.approx(expected_min)  # recorded before the in-place ReLU
    assert rows[1]["min"] == 0.0
    assert len(r.stats(kind="gradient")) == 2


def test_reused_module_records_each_call(tmp_path):
    class Reuse(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(torch.tanh(self.lin(x)))

    model = Reuse()
    with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite")):
        train(model, 2)
    r = TraceReader(tmp_path / "t.sqlite")
    rows = [s for s in r.stats(kind="activation") if s["step"] == 0]
    assert sorted(s["call"] for s in rows) == [0, 1]
    grads = [s for s in r.stats(kind="gradient") if s["step"] == 0]
    assert sorted(s["call"] for s in grads) == [0, 1]


class TupleDictInt(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        return h, {"logits": self.b(h), "count": 3, "ids": torch.arange(3)}, 7


class IntOut(nn.Module):
    def forward(self, x):
        return int(x.shape[0])


class EmptyOut(nn.Module):
    def forward(self, x):
        return x[:0]


def test_tuple_dict_int_outputs(tmp_path):
    model = nn.Sequential()
    model.add_module("body", TupleDictInt())
    inner = model.body
    with ampdoctor.watch(inner, trace=str(tmp_path / "t.sqlite"), all_modules=True):
        train(inner, 2, loss_fn=lambda out: out[1]["logits"].float().pow(2).mean() + out[0].float().mean())
    r = TraceReader(tmp_path / "t.sqlite")
    names = {lay["id"]: lay["name"] for lay in r.layers()}
    slots = {(names[s["layer"]], s["slot"]) for s in r.stats(kind="activation")}
    assert ("", "0") in slots and ("", "1.logits") in slots
    assert not any(s.endswith("ids") or s.endswith("count") for _, s in slots)


def test_named_tuple_outputs_are_slotted_by_field_name(tmp_path):
    """A named tuple's tensors are named by its fields, as a dataclass's or a dict's are (they were
    `0`, `1.h`: by position)."""
    State = collections.namedtuple("State", "h c")

    class Cell(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x)
            return h.sum(), State(h=h, c=torch.tanh(h))

    model = Cell()
    with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite"), all_modules=True):
        train(model, 1, loss_fn=lambda out: out[1].h.float().pow(2).mean() + out[1].c.float().mean())
    slots = {s["slot"] for s in TraceReader(tmp_path / "t.sqlite").stats(kind="activation") if s["layer"] == 0}
    assert slots == {"0", "1.h", "1.c"}, slots


def test_int_and_empty_outputs_do_not_crash(tmp_path):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.n = IntOut()
            self.e = EmptyOut()

        def forward(self, x):
            y = self.lin(x)
            return y * self.n(y) + self.e(y).sum()

    model = M()
    with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite")):
        train(model, 2)
    r = TraceReader(tmp_path / "t.sqlite")
    notes = [e for e in r.events("note")]
    assert any("holds no tensor" in e["detail"]["message"] for e in notes)
    names = {lay["id"]: lay["name"] for lay in r.layers()}
    empty = [s for s in r.stats(kind="activation") if names[s["layer"]] == "e"]
    assert empty and empty[0]["numel"] == 0


def test_first_nonfinite_producer_is_the_linear(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    with torch.no_grad():
        model[2].weight.mul_(40)
    with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite")) as w:
        train(model, 6, make_x=lambda i: torch.randn(4, 8) * (8 ** i))
    ev = [e for e in TraceReader(tmp_path / "t.sqlite").events("first_nonfinite") if e["detail"]["kind"] == "activation"]
    assert ev and ev[0]["layer"] == "2"
    assert w.session.first_nonfinite is not None


class _Doubler(nn.Module):
    """A leaf that changes its input in place, with no ``inplace`` attribute."""

    def forward(self, x):
        x.mul_(2.0)
        return x + 1.0


def test_leaf_pre_hooks_go_after_the_first_recorded_step(tmp_path):
    """Leaves that change no input lose their forward pre-hook after the first recorded step (their
    post-hook takes the input flags); containers, ``inplace`` modules and a leaf seen changing its
    input in place keep theirs; the flags still find the producer of an overflow, and remove()
    restores everything."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), _Doubler(), nn.ReLU(inplace=True), nn.Linear(32, 32), nn.Tanh(),
                          nn.Linear(32, 1))
    before = _module_state(model)
    with torch.no_grad():
        model[3].weight.mul_(40)
    w = ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite"))
    pre = [len(m._forward_pre_hooks) for m in (model, *model)]
    train(model, 1)
    after = [len(m._forward_pre_hooks) for m in (model, *model)]
    assert pre == [1] * 7
    assert after == [1, 0, 1, 1, 0, 0, 0]
    train(model, 6, make_x=lambda i: torch.randn(4, 8) * (8 ** i))
    w.remove()
    assert _module_state(model) == before
    ev = [e for e in TraceReader(tmp_path / "t.sqlite").events("first_nonfinite") if e["detail"]["kind"] == "activation"]
    assert ev and ev[0]["layer"] == "3" and ev[0]["step"] >= 1


class _LateDoubler(nn.Module):
    """A leaf that starts changing its input in place only when ``on`` is set."""

    on = False

    def forward(self, x):
        if self.on:
            x.mul_(2.0)
        return x + 1.0


def test_a_pruned_leaf_that_starts_changing_its_input_gets_its_pre_hook_back(tmp_path):
    model = nn.Sequential(nn.Linear(8, 16), _LateDoubler(), nn.Linear(16, 1))
    model[1].on = False
    before = _module_state(model)
    w = ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite"))
    seen = []
    for i in range(6):
        model[1].on = i >= 3
        train(model, 1)
        seen.append(len(model[1]._forward_pre_hooks))
    assert seen == [0, 0, 0, 1, 1, 1]
    assert len(model[0]._forward_pre_hooks) == len(model[2]._forward_pre_hooks) == 0
    w.remove()
    assert _module_state(model) == before


def test_first_nonfinite_in_a_container_own_op(tmp_path):
    """x*x inside a norm with no children, and q@k^T in an attention whose children stay finite."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), SquareNorm(), nn.Linear(16, 1))
    with ampdoctor.watch(model, trace=str(tmp_path / "n.sqlite")):
        train(model, 1, make_x=lambda i: torch.full((4, 8), 3000.0), scaler=False)
    ev = TraceReader(tmp_path / "n.sqlite").events("first_nonfinite")
    assert ev[0]["layer"] == "1" and ev[0]["detail"]["kind"] == "activation"

    model = nn.Sequential(nn.Linear(8, 16), Attn(16, gain=1.0), nn.Linear(16, 1))
    with torch.no_grad():
        model[0].weight.fill_(0.5)
        model[1].q.weight.copy_(torch.eye(16) * 30)
        model[1].k.weight.copy_(torch.eye(16) * 30)
    with ampdoctor.watch(model, trace=str(tmp_path / "a.sqlite")):
        train(model, 1, make_x=lambda i: torch.ones(1, 3, 8), scaler=False)
    r = TraceReader(tmp_path / "a.sqlite")
    ev = [e for e in r.events("first_nonfinite") if e["detail"]["kind"] == "activation"]
    assert ev[0]["layer"] == "1", ev  # the attention module, not its finite q/k Linear children
    names = {lay["id"]: lay["name"] for lay in r.layers()}
    q = [s for s in r.stats(kind="activation") if names[s["layer"]] == "1.q"]
    assert q and q[0]["nan"] == 0 and q[0]["posinf"] == 0


def test_second_watch_returns_same_handle_and_bad_args(tmp_path):
    model = _model()
    w = ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite"))
    try:
        assert ampdoctor.watch(model) is w
    finally:
        w.remove()
    with pytest.raises(TypeError, match="nn.Module"):
        ampdoctor.watch(lambda x: x)
    with pytest.raises(ValueError, match="every"):
        ampdoctor.watch(model, every=0)
    with pytest.raises(ValueError, match="unknown format"):
        ampdoctor.watch(model, format="fp7")


def test_wrapped_models_are_unwrapped(tmp_path):
    class FakeDDP(nn.Module):  # same shape as DistributedDataParallel: .module
        def __init__(self, m):
            super().__init__()
            self.module = m

        def forward(self, x):
            return self.module(x)

    FakeDDP.__name__ = "DistributedDataParallel"
    inner = _model()
    wrapped = FakeDDP(inner)
    with ampdoctor.watch(wrapped, trace=str(tmp_path / "t.sqlite")):
        train(wrapped, 1)
    r = TraceReader(tmp_path / "t.sqlite")
    assert {lay["name"] for lay in r.layers()} >= {"0", "2", "4"}
    assert any("DistributedDataParallel" in e["detail"]["message"] for e in r.events("note"))


def test_pure_half_model_records_fp16(tmp_path):
    model = _model().half()
    with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite")):
        train(model, 2, scaler=False, autocast=False, make_x=lambda i: torch.randn(4, 8).half())
    r = TraceReader(tmp_path / "t.sqlite")
    assert {s["dtype"] for s in r.stats(kind="weight")} == {"float16"}
    assert all(math.isfinite(s["loss"]) for s in r.steps())


@pytest.mark.parametrize("every", [1, 3])
def test_deferred_host_read_writes_the_same_trace(tmp_path, request, every):
    """On CUDA a recorded step's one host copy is read later: where the next step's backward ends (the
    host work then overlaps the GPU's backward), or at the next boundary, or at remove(). Forced
    here on the CPU: the trace is the one written when each step is read at its own boundary."""

    def record(name, deferred):
        torch.manual_seed(0)
        model = _model()
        seen = []
        if deferred:
            request.getfixturevalue("deferred_read")
        with ampdoctor.watch(model, trace=str(tmp_path / name), every=every) as w:
            orig = w.session.on_backward

            def on_backward(tensors):  # which steps are written when each backward starts
                w.session.writer.commit()
                w.session.writer.flush()
                seen.append(len(TraceReader(tmp_path / name).steps()))
                orig(tensors)

            w.session.on_backward = on_backward
            train(model, 7, make_x=lambda i: torch.randn(4, 8) * (1 + i))
        r = TraceReader(tmp_path / name)
        return r.stats(), r.steps(), [e for e in r.events()], seen

    ref = record("now.sqlite", False)
    got = record("deferred.sqlite", True)
    assert got[0] == ref[0] and len(ref[0]) > 0
    assert [{k: v for k, v in s.items() if k != "wall"} for s in got[1]] == \
           [{k: v for k, v in s.items() if k != "wall"} for s in ref[1]]
    assert got[2] == ref[2]
    if every == 1:
        assert ref[3] == list(range(7))  # read at its own boundary: written before the next step's backward
        # deferred: step i's weights measured and its copy started when step i+1's backward starts, and the
        # step written where that backward ends (its copy has arrived): one step later, not two
        assert got[3] == [0] + list(range(6))



def _weights_edited_at(tmp_path, name, deferred, request, edit_at=2, steps=6):
    """Train with a GradScaler; after ``edit_at``'s update() (the step boundary) and before the next
    backward, halve the first layer's weight in place, as a script that clips or reloads would."""
    torch.manual_seed(0)
    model = _model()
    if deferred:
        request.getfixturevalue("deferred_read")
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    sc = torch.amp.GradScaler("cpu")
    with ampdoctor.watch(model, trace=str(tmp_path / name)):
        for i in range(steps):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 8)).float().pow(2).mean()
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
            opt.zero_grad()
            if i == edit_at:
                with torch.no_grad():
                    model[0].weight.mul_(0.5)
    r = TraceReader(tmp_path / name)
    return [x for x in r.stats() if x["kind"] == "weight"], [e for e in r.events() if e["kind"] == "note"]


def test_deferred_weights_read_at_the_next_backward_and_at_the_boundary_once_a_script_edits_them(tmp_path, request):
    """On CUDA a recorded step's weights are read when the next backward starts, the weights the next
    forward used: the same as after update() unless the script changes them in between. A change is
    seen (the parameters' versions), said in a note, and from then on the weights are read where each
    step ends: every step's rows but the edited one equal those read at each boundary."""
    ref, ref_notes = _weights_edited_at(tmp_path, "now.sqlite", False, request)
    got, notes = _weights_edited_at(tmp_path, "later.sqlite", True, request)
    assert len(got) == len(ref) == 6 * 6 and not ref_notes  # 6 steps, 3 layers' weight and bias
    key = lambda x: (x["step"], x["layer"], x["slot"])  # noqa: E731
    ref, got = sorted(ref, key=key), sorted(got, key=key)
    differ = {key(a) for a, b in zip(ref, got) if a != b}
    assert differ == {(2, got[0]["layer"], "weight")}, differ  # step 2's first weight: halved, read after the edit
    a, b = [x for x in ref if key(x) == (2, got[0]["layer"], "weight")][0], [x for x in got if key(x) == (2, got[0]["layer"], "weight")][0]
    assert b["absmax"] == pytest.approx(a["absmax"] / 2) and b["absmax"] != a["absmax"]
    assert len(notes) == 1 and "changed between the end of step 2 and the next backward" in notes[0]["detail"]["message"]
    assert "the script changed them" in notes[0]["detail"]["message"]


def test_deferred_weights_with_a_second_optimizer_stepping_after_the_first(tmp_path, request):
    """One backward, then two optimizers' steps (dense and sparse parts): the step ends at the first
    optimizer's step, so the second one's update falls between the step's end and the next backward.
    Step 0 is read where it ended (its round was being learnt: see test_steps_frameworks.py); with
    the weights' read waiting for the next backward, step 1 shows the second optimizer's update and
    says why; from step 2 on the weights are read where each step ends, as without the wait."""

    def record(name, deferred):
        torch.manual_seed(0)
        model = _model()
        if deferred:
            request.getfixturevalue("deferred_read")
        first = torch.optim.SGD(model[0].parameters(), lr=0.1)
        second = torch.optim.SGD([p for m in model[1:] for p in m.parameters()], lr=0.1)
        with ampdoctor.watch(model, trace=str(tmp_path / name)):
            for _ in range(4):
                model(torch.randn(4, 8)).pow(2).mean().backward()
                first.step()
                second.step()
                first.zero_grad()
                second.zero_grad()
        r = TraceReader(tmp_path / name)
        rows = sorted((x for x in r.stats() if x["kind"] == "weight"), key=lambda x: (x["step"], x["layer"], x["slot"]))
        return rows, [e["detail"]["message"] for e in r.events("note")]

    ref, ref_notes = record("now.sqlite", False)
    got, notes = record("later.sqlite", True)
    assert len(got) == len(ref) == 4 * 6 and not ref_notes
    differ = {(a["step"], a["layer"]) for a, b in zip(ref, got) if a != b}
    assert {s for s, _ in differ} == {1} and len(differ) == 2, differ  # the second optimizer's two Linears
    assert len(notes) == 1 and "another optimizer stepped after the step ended" in notes[0]


def test_deferred_weights_of_a_watch_removed_before_the_next_backward(tmp_path, deferred_read):
    """With the weights' read waiting for the next backward, a watch removed before it still has the
    last step's weight rows, and the session goes on for the other model."""
    torch.manual_seed(0)
    a, b = _model(), _model()
    wa = ampdoctor.watch(a, trace=str(tmp_path / "t.sqlite"))
    wb = ampdoctor.watch(b)
    opt = torch.optim.SGD(list(a.parameters()) + list(b.parameters()), lr=1e-2)
    for i in range(4):
        (a(torch.randn(4, 8)).pow(2).mean() + b(torch.randn(4, 8)).pow(2).mean()).backward()
        opt.step()
        opt.zero_grad()
        if i == 1:
            wa.remove()
    wb.remove()
    rows = [x for x in TraceReader(tmp_path / "t.sqlite").stats() if x["kind"] == "weight"]
    per_step = collections.Counter(x["step"] for x in rows)
    assert per_step == {0: 12, 1: 12, 2: 6, 3: 6}, per_step  # 6 tensors a model; a's last step is 1


def test_deferred_read_detail_after_a_nonfinite_loss(tmp_path, deferred_read):
    """As test_detail_after_a_nonfinite_loss_wakes_the_hooks, with the host read deferred as on CUDA
    (a NaN loss is then seen inside the next step, where its backward ends): the detail steps start
    at the next boundary, every step marked recorded has its statistics, no other step has any."""
    recorded = _inf_at_step_5(tmp_path, 16)
    assert {0, 4, 8, 10} <= recorded and not {1, 2, 3, 5, 6, 7, 9} & recorded  # (step 8 is written in step 9)
    assert len(recorded - {0, 4, 8, 12}) >= 3  # the detail steps after the NaN loss


def test_flat_tuple_fast_path_matches_the_walk():
    """The inputs/outputs fast path for flat tuples gives what the generic walk gives: the same
    tensors, slot names and order, with scalars, None, non-floating, meta and sparse tensors,
    Parameters and nested containers (walked), past the 64-tensor cap."""
    import random

    from ampdoctor.tensors import floating, iter_tensors
    from ampdoctor.watch import _float_inputs, _float_outputs
    rnd = random.Random(0)
    pool = [torch.randn(2), torch.randn(2).half(), torch.ones(2, dtype=torch.long), None, 3, 2.5, "s", True,
            nn.Parameter(torch.randn(2)), [torch.randn(2)], {"a": torch.randn(2)}, torch.empty(2, device="meta"),
            torch.randn(4).to_sparse()]
    flat = 0
    for _ in range(400):
        k = rnd.randint(0, 70)
        args = tuple(rnd.choice(pool) if rnd.random() < 0.2 else torch.randn(1) for _ in range(k))
        ref = floating(iter_tensors(args))
        assert [(n, id(t)) for n, t in _float_outputs(args)] == [(n, id(t)) for n, t in ref]
        assert [id(t) for t in _float_inputs(args)] == [id(t) for _, t in ref]
        flat += not any(isinstance(a, (list, dict, nn.Parameter)) for a in args)
    assert 50 < flat < 400  # both paths were taken


def test_weight_rows_follow_a_dtype_change(tmp_path):
    """The weight rows' descriptions are kept between steps only while the parameters keep their
    dtype and size: after ``model.double()`` the rows say float64."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite")):
        for i in range(4):
            if i == 2:
                model.double()
            model(torch.randn(4, 8, dtype=torch.float64 if i >= 2 else torch.float32)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    rows = TraceReader(tmp_path / "t.sqlite").stats()
    for kind in ("weight", "weight_grad"):
        got = {(r["step"], r["dtype"]) for r in rows if r["kind"] == kind}
        assert got == {(0, "float32"), (1, "float32"), (2, "float64"), (3, "float64")}, kind



def test_hooks_registered_while_asleep_keep_their_order(tmp_path):
    """every=2: a forward hook a user registers while the watch's hooks sleep (step 1) runs after
    the watch's once they are back (step 2), as registration order says, so the recorded activation
    is the module's own output; one registered with prepend=True meanwhile stays in front."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    handles, seen = [], []

    def make_x(i):
        if i == 1:
            handles.append(model[0].register_forward_hook(lambda m, a, o: o * 1000.0))
            handles.append(model[0].register_forward_hook(lambda m, a, o: None, prepend=True))
        seen.append(list(model[0]._forward_hooks))
        return torch.randn(4, 8)

    early = model[0].register_forward_hook(lambda m, a, o: None)
    w = ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite"), every=2)
    ours = [k for k in model[0]._forward_hooks if k != early.id]
    train(model, 3, make_x=make_x, scaler=False, autocast=False, lr=0.0)
    w.remove()
    late, first = handles
    assert seen[0] == [early.id, *ours] and seen[1] == [first.id, early.id, late.id]  # step 1: asleep
    assert seen[2] == [first.id, early.id, *ours, late.id], (seen, first.id, late.id)
    for h in (early, late, first):
        h.remove()
    r = TraceReader(tmp_path / "t.sqlite")
    names = {v["id"]: v["name"] for v in r.layers()}
    rows = [s for s in r.stats(kind="activation") if names[s["layer"]] == "0"]
    assert [s["step"] for s in rows] == [0, 2]
    assert rows[1]["absmax"] < 100 * rows[0]["absmax"]  # the module's own output, not x1000


def test_inference_mode_forwards_are_not_recorded(tmp_path):
    """A forward under torch.inference_mode() (a sanity-check evaluation before training, between
    steps, or a model only ever run that way) runs as without the watch: inference tensors have no
    version counter. Training around it is recorded as usual."""
    torch.manual_seed(0)
    model = _model()
    x = torch.randn(4, 8)
    with torch.inference_mode():
        want = model(x)
    w = ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite"))
    with torch.inference_mode():
        got = model(x)
    train(model, 2)
    with torch.inference_mode():
        model(x)
    train(model, 1)
    w.remove()
    assert torch.equal(got, want)
    r = TraceReader(tmp_path / "t.sqlite")
    rows = r.stats(kind="activation")
    assert {s["step"] for s in rows} == {0, 1, 2}
    assert max(s["call"] for s in rows) == 0  # the inference forwards added no calls
    assert not [e for e in r.events("note")]


def test_detail_step_after_a_nonfinite_loss_is_attributed(tmp_path):
    """every=5: the loss is non-finite at step 3, which is not recorded; when its boundary reads it
    (on the CPU), the steps after it are recorded in full, and the first of them (4), which produces an
    Inf again, names the producer (before, it was recorded but not attributed, and no event came)."""
    class Boost(nn.Module):
        def __init__(self):
            super().__init__()
            self.factor = 1.0

        def forward(self, x):
            return x * self.factor

    torch.manual_seed(0)
    boost = Boost()
    model = nn.Sequential(nn.Linear(8, 8), boost, nn.Linear(8, 1))

    def make_x(i):
        boost.factor = 1e39 if i in (3, 4) else 1.0  # x * 1e39 is Inf in fp32 from finite inputs
        return torch.randn(4, 8)

    with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite"), every=5):
        train(model, 11, make_x=make_x, autocast=False)  # GradScaler: the Inf steps are skipped
    r = TraceReader(tmp_path / "t.sqlite")
    recorded = [s["step"] for s in r.steps() if s["recorded"]]
    assert recorded[:4] == [0, 4, 5, 6] and 3 not in recorded  # (step 3's loss read where it ended)
    ev = [e for e in r.events("first_nonfinite") if e["detail"]["kind"] == "activation"]
    assert ev and ev[0]["step"] == 4 and ev[0]["layer"] == "1", ev


@pytest.mark.parametrize("every,bad,extra", [(5, 7, [8, 9]), (3, 9, [10, 11]), (10, 3, [4, 5, 6])])
def test_three_steps_in_full_after_a_nonfinite_loss(tmp_path, every, bad, extra):
    """README --every: the next 3 steps after the boundary that reads a non-finite loss are recorded in
    full (a regular step among them counts as one of the three). There were four: the step forced on
    when the loss was read was not counted. On the CPU each step's loss is read where it ends (it was
    read with the next recorded step's: a kill lost up to N steps of losses)."""
    _three_steps(tmp_path, every, bad, extra)


@pytest.mark.parametrize("every,bad,extra", [(5, 7, [12, 13, 14]), (3, 9, [11, 13]), (10, 3, [12, 13, 14])])
def test_three_steps_in_full_after_a_nonfinite_loss_read_on_the_gpu(tmp_path, deferred_read, every, bad, extra):
    """As above, with the losses read as on CUDA: with the next recorded step's, inside the step after it
    (so from the boundary after that; with every=3 step 12 is a regular one and counts as one of them)."""
    _three_steps(tmp_path, every, bad, extra)


def _three_steps(tmp_path, every, bad, extra):
    m = nn.Linear(4, 4)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    path = tmp_path / "t.sqlite"
    with ampdoctor.watch(m, format="fp16", every=every, trace=str(path)):
        for s in range(25):
            loss = m(torch.ones(4)).sum() + torch.tensor(math.nan if s == bad else 0.0)  # NaN in the value only
            loss.backward()
            opt.step()
            opt.zero_grad()
    with TraceReader(path) as r:
        got = sorted({x["step"] for x in r.stats()})
    assert [s for s in got if s % every] == extra, got


def test_evaluation_forwards_are_not_recorded_into_training_steps(tmp_path):
    """Once training has started, a call of the model with gradients disabled (validation under
    torch.no_grad()) is evaluation: not recorded, so the training step's rows keep the training
    forward's dtypes, values and call count. A no-grad region inside the training forward (a frozen
    part run under torch.no_grad(), reentrant checkpointing) is still recorded, with a note that it
    has no gradient rows. No-grad calls before any training are evaluation too once a training call
    follows in the same step (Lightning's sanity check); an inference-only watch records them (see
    test_no_grad_calls_before_training)."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.frozen = nn.Linear(8, 8)
            self.body = nn.Linear(8, 8)
            self.head = nn.Linear(8, 1)

        def forward(self, x):
            with torch.no_grad():
                x = self.frozen(x)
            return self.head(torch.relu(self.body(x)))

    torch.manual_seed(0)
    model = Net()
    path = tmp_path / "t.sqlite"
    val = torch.full((4, 8), 1000.0)

    def make_x(i):
        with torch.no_grad():  # validation before each training step (fp32, other values)
            model(val)
        return torch.randn(4, 8)

    w = ampdoctor.watch(model, trace=str(path))
    with torch.no_grad():
        model(val)  # before any training, and a training call follows: evaluation
    train(model, 3, make_x=make_x)
    w.remove()
    r = TraceReader(path)
    names = {v["id"]: v["name"] for v in r.layers()}
    rows = r.stats(kind="activation")
    calls = {}
    for s in rows:
        calls.setdefault((s["step"], names[s["layer"]]), []).append(s["call"])
    # step 0: the two no-grad calls before the first backward were evaluation (they were recorded as
    # calls 0 and 1, the training forward as call 2)
    assert calls[(0, "body")] == [0]
    assert calls[(1, "body")] == [0] and calls[(2, "body")] == [0]  # validation after training started: not recorded
    assert calls[(1, "frozen")] == [0]  # the frozen part of the training forward: recorded
    assert {s["dtype"] for s in rows if s["step"] > 0 and names[s["layer"]] == "body"} == {"float16"}
    notes = [e for e in r.events("note") if e["layer"] == "frozen"]
    assert len(notes) == 1 and "gradients disabled" in notes[0]["detail"]["message"]
    assert not [e for e in r.events("note") if e["layer"] in ("body", "head")]
    assert {names[s["layer"]] for s in r.stats(kind="gradient")} == {"body", "head"}


def test_no_grad_calls_before_training(tmp_path):
    """Lightning's sanity-check validation (and a summary's example forward) runs the model under
    torch.no_grad() before the first training step. Its calls were recorded into step 0: a
    validation batch that overflowed made the first layer "the first non-finite producer, at step 0",
    though training broke at step 2 in another layer. An inference-only watch still records them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].weight.fill_(0.1), model[0].bias.zero_()
        model[2].weight.fill_(0.5), model[2].bias.zero_()

    def make_x(i):  # model[0] gives 0.8 x (2.4e4 at step 2: finite); model[2] 3.2 x that (inf at step 2)
        return torch.full((4, 8), 1.0 if i < 2 else 3e4)

    path = tmp_path / "t.sqlite"
    with ampdoctor.watch(model, trace=str(path)):
        model.eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
            for _ in range(2):
                model(torch.full((4, 8), 1e5))  # sanity-check batches: model[0] overflows
        model.train()
        train(model, 3, make_x=make_x)
    r = TraceReader(path)
    names = {v["id"]: v["name"] for v in r.layers()}
    step0 = [s for s in r.stats(kind="activation") if s["step"] == 0]
    assert step0 and {s["call"] for s in step0} == {0}
    assert not any(s["nan"] or s["posinf"] or s["neginf"] for s in step0)
    ev = [e for e in r.events("first_nonfinite") if e["detail"]["kind"] == "activation"]
    assert ev and (ev[0]["step"], ev[0]["layer"]) == (2, "2"), ev

    # only inference: recorded (one partial step), with the overflow it shows
    model2 = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    with ampdoctor.watch(model2, trace=str(tmp_path / "i.sqlite")), torch.no_grad():
        model2(torch.full((4, 8), 1e6).half().float())
        model2(torch.ones(4, 8))
    r = TraceReader(tmp_path / "i.sqlite")
    names = {v["id"]: v["name"] for v in r.layers()}
    rows = r.stats(kind="activation")
    assert sorted((names[s["layer"]], s["call"]) for s in rows) == [("0", 0), ("0", 1), ("1", 0), ("1", 1),
                                                                    ("2", 0), ("2", 1)]


def test_evaluation_through_a_part_of_the_model_is_not_recorded(tmp_path):
    """Validation that calls a part of the watched model (Lightning's validation_step calling
    self.model, a head alone) under torch.no_grad() after training started: the outermost watched
    call decides, so nothing of it is recorded and no 'gradients disabled' note is written."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 1))

    def make_x(i):
        with torch.no_grad():
            model[0](torch.full((4, 8), 1000.0))
            model[1](torch.full((4, 8), 1000.0))
        return torch.randn(4, 8)

    with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite")):
        train(model, 3, make_x=make_x, autocast=False)
    r = TraceReader(tmp_path / "t.sqlite")
    rows = [s for s in r.stats(kind="activation") if s["step"] > 0]
    assert rows and max(s["call"] for s in rows) == 0 and max(s["absmax"] for s in rows) < 100
    assert not [e for e in r.events("note") if "gradients disabled" in e["detail"].get("message", "")]


def test_evaluation_of_a_one_layer_model_is_not_recorded(tmp_path):
    """A model that is one leaf keeps only its forward hook after the first recorded step; an
    evaluation call of it after training started is still not recorded."""
    torch.manual_seed(0)
    model = nn.Linear(8, 1)

    def make_x(i):
        with torch.no_grad():
            model(torch.full((4, 8), 1000.0))
        return torch.randn(4, 8)

    with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite")) as w:
        train(model, 3, make_x=make_x, autocast=False)
        assert not model._forward_pre_hooks  # pruned
    rows = [s for s in TraceReader(tmp_path / "t.sqlite").stats(kind="activation") if s["step"] > 0]
    assert rows and max(s["call"] for s in rows) == 0 and max(s["absmax"] for s in rows) < 100
    assert w.session.trained


def test_reentrant_checkpoint_is_recorded_with_a_note(tmp_path):
    """checkpoint(..., use_reentrant=True) runs its segment with gradients disabled inside the
    training forward: the segment's outputs are recorded each step, and a note says there are no
    gradient rows for them."""
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 1)

        def forward(self, x):
            return self.b(checkpoint(self.a, x, use_reentrant=True))

    torch.manual_seed(0)
    model = Net()
    with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite")):
        train(model, 3, make_x=lambda i: torch.randn(4, 8, requires_grad=True), autocast=False)
    r = TraceReader(tmp_path / "t.sqlite")
    names = {v["id"]: v["name"] for v in r.layers()}
    assert sorted(s["step"] for s in r.stats(kind="activation") if names[s["layer"]] == "a") == [0, 1, 2]
    notes = [e for e in r.events("note") if e["layer"] == "a"]
    assert len(notes) == 1 and "use_reentrant" in notes[0]["detail"]["message"]


def test_a_trace_path_not_chosen_is_printed_once(tmp_path, capsys):
    model = _model()
    w = ampdoctor.watch(model)
    train(model, 1)
    w.remove()
    err = capsys.readouterr().err
    assert err.count("ampdoctor: recording to") == 1 and str(w.trace_path) in err
    with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite")):
        train(model, 1)
    assert "recording to" not in capsys.readouterr().err


def test_a_new_optimizer_or_parameter_is_followed(tmp_path):
    """Without a GradScaler a step ends at the first optimizer's step. An optimizer made anew ends
    the steps from then on, whether the old one is gone or kept alive (it holds every parameter: no
    other optimizer is waited for); a parameter replaced (module.weight = nn.Parameter(...)) is
    recorded where it is now."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    path = tmp_path / "t.sqlite"
    with ampdoctor.watch(model, trace=str(path)):
        for _ in range(3):  # a new optimizer each step: the last one is freed
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        model[2].weight = nn.Parameter(torch.full((1, 4), 10.0))
        keep = opt  # alive but no longer used
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    del keep
    r = TraceReader(path)
    assert [s["optimizer_steps"] for s in r.steps()] == [1, 2, 3, 4, 5, 6]
    names = {v["id"]: v["name"] for v in r.layers()}
    w2 = [s for s in r.stats(kind="weight") if names[s["layer"]] == "2" and s["slot"] == "weight"]
    assert [s["absmax"] for s in w2][3:] == [10.0, 10.0, 10.0]
    g2 = [s["step"] for s in r.stats(kind="weight_grad") if names[s["layer"]] == "2" and s["slot"] == "weight"]
    assert g2 == [0, 1, 2, 3, 4, 5]


class _Gen(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8))

    def forward(self, z):
        return self.net(z)


class _Disc(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x):
        return self.net(x)


def test_two_watched_models_are_not_merged(tmp_path, monkeypatch):
    """watch(g) and watch(d) (a GAN): the second model's layers are named ``Class:name``, as under
    automatic watching, not merged with the first's same-named layers. A trial's FP32 names are
    each model's own: ``net.2`` is g's, ``_Disc:net.2`` d's."""
    torch.manual_seed(0)
    g, d = _Gen(), _Disc()
    path = tmp_path / "t.sqlite"
    with ampdoctor.watch(g, trace=str(path)), ampdoctor.watch(d):
        opt = torch.optim.SGD([*g.parameters(), *d.parameters()], lr=0.01)
        for _ in range(2):
            d(g(torch.randn(4, 4))).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    r = TraceReader(path)
    names = {v["id"]: v["name"] for v in r.layers()}
    assert {"net.0", "net.2", "_Disc:", "_Disc:net.0", "_Disc:net.2"} <= set(names.values())
    acts = [s for s in r.stats(kind="activation") if s["step"] == 0]
    assert sorted(names[s["layer"]] for s in acts if names[s["layer"]].endswith("net.2")) == ["_Disc:net.2", "net.2"]
    assert all(s["call"] == 0 for s in acts)  # one call each, not two calls of one merged layer

    monkeypatch.setenv("AMPDOCTOR_CONFIG", json.dumps({"trace": str(tmp_path / "f.sqlite"), "force_fp32": ["net.2"]}))
    g, d = _Gen(), _Disc()
    with ampdoctor.watch(g), ampdoctor.watch(d):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert g(torch.randn(4, 4)).dtype == torch.float32  # forced: g's net.2
            assert d(torch.randn(4, 8)).dtype == torch.bfloat16  # not d's net.2


def test_a_model_on_the_meta_device_is_noted_not_an_internal_error(tmp_path):
    # a dry run on the meta device (shapes only): every step is written, with a note that there are
    # no values, not "internal error while recording" (copying the meta loss or weights to the host)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)).to("meta")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite")):
        for _ in range(2):
            model(torch.randn(4, 8, device="meta")).sum().backward()
            opt.step()
    r = TraceReader(tmp_path / "t.sqlite")
    assert [s["step"] for s in r.steps()] == [0, 1]
    notes = [e["detail"]["message"] for e in r.events("note")]
    assert not any("internal error" in n for n in notes), notes
    assert any("meta device" in n for n in notes), notes


def test_tensor_hooks_registered_without_a_handle_keep_torch_order_and_ids():
    """The watch registers its gradient hooks the way Tensor.register_hook does, without the
    handle object: hooks before and after it run in registration order (on a leaf and on a non-leaf
    tensor), and a handle taken after it removes only its own hook."""
    from ampdoctor.watch import _new_hook
    for leaf in (False, True):
        x = torch.ones(3, requires_grad=True)
        t = x if leaf else x * 2
        seen = []
        h1 = t.register_hook(lambda g, seen=seen: seen.append("user-1"))
        _new_hook(t, lambda g, seen=seen: seen.append("ours"))
        h2 = t.register_hook(lambda g, seen=seen: seen.append("user-2"))
        assert len(t._backward_hooks) == 3  # no id taken twice
        t.sum().backward(retain_graph=True)
        assert seen == ["user-1", "ours", "user-2"], leaf
        h1.remove()
        h2.remove()
        seen.clear()
        t.sum().backward()
        assert seen == ["ours"], leaf
    t = torch.ones(3, requires_grad=True) * 3  # no hook yet: the dictionary is made here
    got = []
    _new_hook(t, lambda g: got.append(g.clone()))
    t.sum().backward()
    assert len(got) == 1 and torch.equal(got[0], torch.ones(3))


def _wrap_in_autocast(model, dtype, touch=False):
    """``model.forward`` entering autocast itself, as accelerate's ``prepare`` (and so the HF
    Trainer) wraps it: the outermost module's hooks run outside autocast. ``touch``: the wrapper
    changes the input in place before it enters autocast."""
    inner = model.forward

    @functools.wraps(inner)
    def forward(x):
        if touch:
            x.mul_(1.0)
        with torch.autocast("cpu", dtype=dtype):
            return inner(x).float()
    model.forward = forward
    return model


def _autocast_run(tmp_path, name, fmt=None, dtype=torch.bfloat16, half_model=False, autocast=True,
                  wrapped=False, kind="activation"):
    torch.manual_seed(0)
    model = _model()
    if half_model:
        model = model.to(dtype)
    if wrapped:
        _wrap_in_autocast(model, dtype, touch=wrapped == "touch")
        autocast = False
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with ampdoctor.watch(model, trace=str(tmp_path / name), format=fmt):
        for _ in range(2):
            x = torch.randn(4, 8, dtype=dtype if half_model else torch.float32) * 1e3
            with torch.autocast("cpu", dtype=dtype, enabled=autocast):
                loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    r = TraceReader(tmp_path / name)
    return r.meta(), r.stats(kind=kind)


@pytest.mark.parametrize("case,expect", [
    (dict(), ("bf16", "autocast to bfloat16")),
    (dict(dtype=torch.float16), ("fp16", "autocast to float16")),
    (dict(half_model=True, autocast=False), ("bf16", "bfloat16 parameters")),
    (dict(half_model=True, autocast=False, dtype=torch.float16), ("fp16", "float16 parameters")),
    (dict(autocast=False), ("fp16", "the FP16 readiness check")),
    (dict(wrapped=True), ("bf16", "autocast to bfloat16")),
    (dict(wrapped=True, dtype=torch.float16), ("fp16", "autocast to float16")),
    (dict(wrapped=True, kind=None), ("bf16", "autocast to bfloat16")),
])
def test_format_not_given_is_the_one_the_run_trains_in(tmp_path, case, expect):
    """watch(model) with no format measures against what the first watched forward runs in
    (autocast's dtype, else the parameters' fp16/bf16 dtype, else fp16), says so in the trace's
    metadata, and its rows are those of an explicit watch(model, format=that)."""
    meta, rows = _autocast_run(tmp_path, "auto.sqlite", **case)
    assert meta["format"] == expect[0] and expect[1] in meta["format_detected"]
    meta2, rows2 = _autocast_run(tmp_path, "given.sqlite", fmt=expect[0], **case)
    assert meta2["format"] == expect[0] and "format_detected" not in meta2
    strip = lambda rs: [{k: v for k, v in r.items() if k != "id"} for r in rs]  # noqa: E731
    assert strip(rows) == strip(rows2) and rows


def test_format_seen_too_late_to_measure_again_stays_fp16_and_says_so(tmp_path):
    """The wrapper of a forward that enters autocast changes the already measured input in place
    first: its row cannot be measured again against bf16, so the trace stays fp16, consistently,
    and its metadata says why."""
    meta, rows = _autocast_run(tmp_path, "auto.sqlite", wrapped="touch", kind=None)
    assert meta["format"] == "fp16"
    assert "autocast to bfloat16" in meta["format_detected"] and "stays measured against fp16" in meta["format_detected"]
    meta2, rows2 = _autocast_run(tmp_path, "given.sqlite", fmt="fp16", wrapped="touch", kind=None)
    strip = lambda rs: [{k: v for k, v in r.items() if k != "id"} for r in rs]  # noqa: E731
    assert strip(rows) == strip(rows2) and rows


@pytest.mark.parametrize("grad", [False, True])
def test_a_shape_check_forward_before_training_does_not_decide_the_format(tmp_path, grad):
    """A model summary's or shape check's forward outside autocast (under no_grad, or with gradients on
    and no backward) came before bf16 autocast training: the format is the training's, bf16, and the
    rows are those of watch(format="bf16"). It was fp16, a readiness check, with overflow on values
    that are fine in bf16."""
    def run(name, fmt=None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        with torch.no_grad():
            model[0].weight.mul_(1e5)  # activations about 1e5: fp16 overflow, fine in bf16
        opt = torch.optim.SGD(model.parameters(), lr=1e-9)
        kw = {} if fmt is None else {"format": fmt}
        with ampdoctor.watch(model, trace=str(tmp_path / name), **kw):
            with torch.set_grad_enabled(grad):
                model(torch.zeros(1, 8))
            for _ in range(2):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = nn.functional.cross_entropy(model(torch.randn(4, 8)), torch.tensor([0, 1, 0, 1]))
                loss.backward()
                opt.step()
                opt.zero_grad()
        r = TraceReader(tmp_path / name)
        return r.meta(), [{k: v for k, v in row.items() if k != "id"} for row in r.stats()]

    meta, rows = run("auto.sqlite")
    assert meta["format"] == "bf16" and "autocast to bfloat16" in meta["format_detected"], meta
    meta2, rows2 = run("given.sqlite", "bf16")
    assert rows == rows2 and not any(r["overflow"] for r in rows)


def test_explicit_format_wins_over_the_run(tmp_path):
    """format="fp16" on a bf16 autocast run is an fp16 readiness check: its activations beyond 65504
    (finite in bf16) count as fp16 overflow; measured against bf16 (auto) the same values do not."""
    meta, rows = _autocast_run(tmp_path, "fp16.sqlite", fmt="fp16")
    assert meta["format"] == "fp16"
    auto_meta, auto_rows = _autocast_run(tmp_path, "auto.sqlite")
    assert auto_meta["format"] == "bf16"
    assert [r["absmax"] for r in rows] == [r["absmax"] for r in auto_rows]
    beyond = [i for i, r in enumerate(rows) if r["absmax"] > 65504]
    assert beyond and all(rows[i]["overflow"] > 0 and auto_rows[i]["overflow"] == 0 for i in beyond)


def test_the_report_of_fp16_on_a_bf16_run_is_an_fp16_readiness_check(tmp_path):
    """The README says --format fp16 on a bf16 script is an FP16 readiness check; the report said the
    format was a mistake ('rerun with --format bf16') and gave no readiness lines, only the table."""
    from ampdoctor.report.html import render_html
    from ampdoctor.report.model import build_report
    from ampdoctor.report.readiness import readiness
    meta, rows = _autocast_run(tmp_path, "fp16.sqlite", fmt="fp16")
    rep = build_report(tmp_path / "fp16.sqlite")
    over = sorted({r["layer"] for r in rows if r["overflow"]})
    names = {lay["id"]: lay["name"] for lay in TraceReader(tmp_path / "fp16.sqlite").layers()}
    ready = readiness(rep)
    assert over and ready is not None and ready["ran"] == ["bfloat16"]
    assert sorted({names[r["layer"]] for r in rows if r["overflow"]}) == sorted({r.layer for r in ready["overflow"]["activation"]})
    lines, advice = "\n".join(rep.diagnosis.lines), "\n".join(rep.advice)
    assert "Activations ran in bfloat16 and are measured against fp16: an fp16 readiness check" in lines, lines
    assert "to judge them as they ran" in lines and "to judge them by what they are" not in lines
    assert (f"fp16 readiness: the activations of this run ran in bfloat16 (float32 where autocast keeps it), so its values "
            f"were measured against fp16: {len(over)} of ") in advice, advice
    assert "Would overflow in fp16 (max 65504): outputs of " in advice and "when you switch autocast to fp16" in advice
    body = render_html(rep)
    assert "Diagnosis: fp16 readiness" in body and "ran in bfloat16" in body and "every activation was float32" not in body
    # measured against what it ran in, the same run is no readiness check
    _autocast_run(tmp_path, "auto.sqlite")
    auto = build_report(tmp_path / "auto.sqlite")
    assert readiness(auto) is None and not any("readiness" in a for a in auto.advice)


@pytest.mark.parametrize("leaf", [False, True])
def test_a_validation_pass_in_eval_mode_without_no_grad_is_not_recorded_as_training(tmp_path, leaf):
    """model.eval() and a forward with gradients enabled (a validation loop that forgot no_grad) after
    training started: evaluation, as under no_grad. It was recorded as a call of the next step (its
    1e5 inputs were that step's abs-max), and a last one made a step of its own with no loss."""
    torch.manual_seed(0)
    model = nn.Linear(8, 1) if leaf else nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite")):
        for i in range(6):
            model.train()
            loss = model(torch.randn(4, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if i % 2 == 1:
                model.eval()
                model(torch.full((4, 8), 1e5)).pow(2).mean()
    r = TraceReader(tmp_path / "t.sqlite")
    assert [s["step"] for s in r.steps()] == list(range(6)) and all(s["loss"] is not None for s in r.steps())
    acts = r.stats(kind="activation")
    assert {s["call"] for s in acts} == {0} and max(s["absmax"] for s in acts) < 100
    assert {s["step"] for s in acts} == set(range(6))


def test_a_model_trained_in_eval_mode_is_still_recorded(tmp_path):
    # (dropout kept off by training in eval mode: eval mode is no sign of evaluation then)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    model.eval()
    with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite")):
        train(model, 4)
    acts = TraceReader(tmp_path / "t.sqlite").stats(kind="activation")
    assert {s["step"] for s in acts} == set(range(4)) and len(acts) == 4 * 3


@pytest.mark.parametrize("how,status,said", [
    ("raise", "crashed", "The script raised: RuntimeError: data loader died"),
    ("ctrl-c", "interrupted", "The run was interrupted (KeyboardInterrupt)"),
    ("exit", "exited", "The script exited with status 3")])
def test_a_with_watch_block_ended_by_an_exception_says_how_the_run_ended(tmp_path, how, status, said):
    """A crash, Ctrl-C or sys.exit(3) inside `with ampdoctor.watch(model):` was stamped finished, and the
    report said only 'Training did not break in the 3 steps seen'."""
    from ampdoctor.report import build_report
    model = _model()
    exc = {"raise": RuntimeError("data loader died"), "ctrl-c": KeyboardInterrupt(), "exit": SystemExit(3)}[how]
    with pytest.raises(type(exc)):
        with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite")):
            train(model, 3)
            raise exc
    assert TraceReader(tmp_path / "t.sqlite").meta()["status"] == status
    assert any(line.startswith(said) for line in build_report(tmp_path / "t.sqlite").diagnosis.lines)


def test_a_step_cut_short_by_a_crash_is_counted_as_cut_short(tmp_path):
    """A crash after the forward of step 3: the report said 'Training did not break in the 4 steps seen' where
    `ampdoctor run` said 3 completed; the count now says the last one was cut short. A run that ends at a
    step boundary says nothing of the kind."""
    from ampdoctor.report import build_report
    from ampdoctor.report.html import render_html
    from ampdoctor.report.text import render_text
    model = _model()
    with pytest.raises(RuntimeError):
        with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite")):
            train(model, 3)
            model(torch.randn(4, 8))
            raise RuntimeError("data loader died")
    assert TraceReader(tmp_path / "t.sqlite").meta()["last_step_partial"] is True
    rep = build_report(tmp_path / "t.sqlite")
    said = "4 steps seen (the last cut short by the crash: 3 completed)"
    assert rep.diagnosis.lines[0] == f"Training did not break in the {said}.", rep.diagnosis.lines
    assert "4 steps (the last cut short by the crash: 3 completed), 3 optimizer steps" in render_text(rep, width=400)
    assert said in render_html(rep)
    model = _model()
    with ampdoctor.watch(model, trace=str(tmp_path / "u.sqlite")):
        train(model, 3)
    assert "last_step_partial" not in TraceReader(tmp_path / "u.sqlite").meta()
    assert build_report(tmp_path / "u.sqlite").diagnosis.lines[0] == "Training did not break in the 3 steps seen."


def test_a_measurement_cut_short_by_ctrl_c_writes_no_rows_of_nan_counts(tmp_path, monkeypatch):
    """A Ctrl-C that lands while a step's weight gradients are measured: the step is written as the run ends
    with its unmeasured rows' NaN counts cast to int64's minimum, false NaN/Inf events, and every report of
    the trace raised 'integer overflow'. Those rows are left out now."""
    from ampdoctor import stats as stats_mod
    from ampdoctor.report import build_report
    model = _model()
    orig, state = stats_mod._torch_batch, {"step": 0, "armed": False}
    orig_add = session_mod.Session.add_param_rows

    def add_param_rows(self, kind, *a, **k):
        state["armed"] = kind == "weight_grad" and state["step"] == 2
        try:
            return orig_add(self, kind, *a, **k)
        finally:
            state["armed"] = False

    def batch(ts, fmt):
        if state["armed"]:
            raise KeyboardInterrupt
        return orig(ts, fmt)

    monkeypatch.setattr(session_mod.Session, "add_param_rows", add_param_rows)
    monkeypatch.setattr(stats_mod, "_torch_batch", batch)
    w = ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite"))
    with pytest.raises(KeyboardInterrupt):
        for i in range(5):
            state["step"] = i
            train(model, 1)
    w.remove()
    r = TraceReader(tmp_path / "t.sqlite")
    assert min(min(s["nan"], s["posinf"], s["overflow"]) for s in r.stats()) >= 0
    assert not [e for e in r.events() if e["kind"] in ("first_nonfinite", "grad_nonfinite")]
    rep = build_report(tmp_path / "t.sqlite")
    assert rep.diagnosis.first_nonfinite is None
