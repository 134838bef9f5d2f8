"""watch() on training code the authors did not write: checkpoints and copies of a watched model,
parameters passed as inputs, keyword inputs, evaluation calls that raise, the AMP docs' gradient
penalty, gradients from torch.autograd.grad, nested watches, a second trace path."""

from __future__ import annotations

import copy
import io
import logging
import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.trace import TraceReader


def _ours(module: nn.Module) -> list:
    """The hooks of ampdoctor's watch in a module tree (its closures live in ampdoctor.watch)."""
    found = []
    for m in module.modules():
        for d in (m._forward_pre_hooks, m._forward_hooks):
            found += [h for h in d.values() if getattr(h, "__module__", "") == "ampdoctor.watch"]
    return found


def _step(model, opt, x):
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def test_torch_save_and_deepcopy_of_a_watched_model_leave_the_hooks_behind(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    w = ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite"))
    _step(model, opt, torch.randn(4, 8))
    assert _ours(model)  # awake: a recorded step comes next
    buf = io.BytesIO()
    torch.save(model, buf)  # raised "Can't pickle local object 'Watch._make_post.<locals>.post'"
    assert b"ampdoctor" not in buf.getvalue() and b"ampdoctor" not in pickle.dumps(model)
    assert _ours(model)  # the watched model keeps its hooks
    teacher = copy.deepcopy(model)  # an EMA / teacher copy
    assert not _ours(teacher)
    with torch.no_grad():
        for p in teacher.parameters():
            p.mul_(1000.0)
    teacher(torch.randn(4, 8)).sum().backward()  # its forward is not the watched model's
    _step(model, opt, torch.randn(4, 8))
    w.remove()
    r = TraceReader(tmp_path / "t.sqlite")
    first = next(lay["id"] for lay in r.layers() if lay["name"] == "0")
    assert {s["slot"] for s in r.stats(kind="activation") if s["layer"] == first} == {"out"}
    assert max(s["absmax"] for s in r.stats(kind="activation") if s["layer"] == first) < 100
    assert max(s["call"] for s in r.stats(kind="activation")) == 0  # no second call of "0"
    # the checkpoint loads in a process that has no ampdoctor to import
    path = tmp_path / "m.pt"
    path.write_bytes(buf.getvalue())
    code = ("import sys, torch; sys.modules['ampdoctor'] = None; "
            f"m = torch.load({str(path)!r}, weights_only=False); print(type(m).__name__, len(m[0]._forward_hooks))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["Sequential", "0"]


def test_a_parameter_passed_as_an_input_keeps_no_hook_of_ours(tmp_path):
    class Queries(nn.Module):  # learned queries / a cls token: a parameter given to a submodule
        def __init__(self):
            super().__init__()
            self.queries = nn.Parameter(torch.randn(4, 8))
            self.proj = nn.Linear(8, 1)

        def forward(self, x):
            return self.proj(self.queries) + x.sum()

    model = Queries()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    w = ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite"))
    for _ in range(6):
        _step(model, opt, torch.randn(4, 8))
        assert not model.queries._backward_hooks  # grew by one entry a step, for good
    w.remove()
    assert not model.queries._backward_hooks
    assert TraceReader(tmp_path / "t.sqlite").stats(kind="weight_grad")


def test_a_nan_in_data_given_by_keyword_is_the_input_not_the_model(tmp_path):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 1)

        def forward(self, inputs_embeds=None):  # as Hugging Face models are called
            return self.b(torch.relu(self.a(inputs_embeds * 0.5)))

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    sc = torch.amp.GradScaler("cpu", init_scale=8.0)
    with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite")) as w:
        for step in range(3):
            x = torch.randn(4, 8)
            if step == 1:
                x[0, 0] = float("nan")
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(inputs_embeds=x).float().pow(2).mean()
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
            opt.zero_grad()
        d = w.report().to_dict()
    lines = " ".join(d["diagnosis"]["lines"])
    assert "the input of a was already non-finite" in lines, lines
    assert not any("keep_fp32" in a for a in d["advice"])


def test_an_evaluation_call_that_raises_does_not_hide_the_next_training_step(tmp_path):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 1)

        def forward(self, x):
            h = self.a(x)
            if x.shape[0] == 3:
                raise ValueError("a malformed validation batch")
            return self.b(h)

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite")):
        for step in range(4):
            _step(model, opt, torch.randn(4, 8))
            if step == 1:
                with torch.no_grad():
                    for bs in (4, 3):
                        try:
                            model(torch.randn(bs, 8))
                        except ValueError:
                            pass
    r = TraceReader(tmp_path / "t.sqlite")
    names = {lay["id"]: lay["name"] for lay in r.layers()}
    for step in range(4):
        acts = sorted((names[s["layer"]], s["call"]) for s in r.stats(kind="activation") if s["step"] == step)
        grads = sorted(names[s["layer"]] for s in r.stats(kind="gradient") if s["step"] == step)
        assert acts == [("a", 0), ("b", 0)] and grads == ["a", "b"], (step, acts, grads)


def test_the_amp_gradient_penalty_recipe_records_the_loss_backpropagated(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    true = []
    with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite")):
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 8)).float().pow(2).mean()
            grads = torch.autograd.grad(scaler.scale(loss), model.parameters(), create_graph=True)
            inv = 1.0 / scaler.get_scale()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss + sum(((g * inv) ** 2).sum() for g in grads).sqrt()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            true.append(loss.item())
    got = [s["loss"] for s in TraceReader(tmp_path / "t.sqlite").steps()]
    np.testing.assert_allclose(got, true, rtol=1e-6)  # the bare loss was counted twice


def test_gradients_from_autograd_grad_assigned_to_grad_get_rows(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    seen = []
    with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite")):
        for _ in range(3):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            for p, g in zip(model.parameters(), torch.autograd.grad(loss, list(model.parameters()))):
                p.grad = g
            seen.append([p.grad.detach().numpy().copy() for p in model.parameters()])
            opt.step()
            opt.zero_grad()
    r = TraceReader(tmp_path / "t.sqlite")
    rows = r.stats(kind="weight_grad")
    assert len(rows) == 3 * 4
    names = {lay["id"]: lay["name"] for lay in r.layers()}
    index = {("0", "weight"): 0, ("0", "bias"): 1, ("2", "weight"): 2, ("2", "bias"): 3}
    for row in rows:
        ref = seen[row["step"]][index[names[row["layer"]], row["slot"]]]
        assert row["absmax"] == float(np.abs(ref).max()) and row["numel"] == ref.size
        assert row["min"] == float(ref.min()) and row["max"] == float(ref.max())
    assert any("torch.autograd.grad" in e["detail"]["message"] for e in r.events("note"))


def test_watching_a_part_of_a_watched_model_records_each_layer_once(tmp_path, caplog):
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    w = ampdoctor.watch(model, trace=str(tmp_path / "a.sqlite"))
    assert ampdoctor.watch(model[1]) is w
    _step(model, opt, torch.randn(4, 8))
    w.remove()
    names = [lay["name"] for lay in TraceReader(tmp_path / "a.sqlite").layers()]
    assert sorted(names) == ["", "0", "1", "1.0", "1.1", "2"]

    other = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 1))
    opt = torch.optim.SGD(other.parameters(), lr=1e-2)
    ws = ampdoctor.watch(other[1], trace=str(tmp_path / "b.sqlite"))  # the part first, then the whole
    with caplog.at_level(logging.WARNING, logger="ampdoctor.watch"):
        wm = ampdoctor.watch(other)
    assert "is watched on its own already" in caplog.text
    _step(other, opt, torch.randn(4, 8))
    wm.remove()
    ws.remove()
    r = TraceReader(tmp_path / "b.sqlite")
    names = {lay["id"]: lay["name"] for lay in r.layers()}
    acts = [names[s["layer"]] for s in r.stats(kind="activation")]
    assert len(acts) == len(set(acts)) == 4  # each leaf's output once: 2 in the part, 2 outside it
    assert len(r.stats(kind="weight_grad")) == 6  # three Linear layers, weight and bias, once each


def test_a_second_trace_path_is_said_to_be_ignored(tmp_path, caplog):
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    wa = ampdoctor.watch(a, trace=str(tmp_path / "a.sqlite"))
    with caplog.at_level(logging.WARNING, logger="ampdoctor.watch"):
        wb = ampdoctor.watch(b, trace=str(tmp_path / "b.sqlite"))
    assert "ignoring trace=" in caplog.text and str(tmp_path / "a.sqlite") in caplog.text
    assert str(wb.trace_path) == str(tmp_path / "a.sqlite")
    wb.remove()
    wa.remove()


def test_watch_does_not_import_dynamo_and_a_later_compile_still_keeps_the_hooks_eager(tmp_path):
    code = textwrap.dedent(f"""
        import sys, warnings
        import torch
        from torch import nn
        import ampdoctor
        from ampdoctor.trace import TraceReader
        filters = list(warnings.filters)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        w = ampdoctor.watch(model, trace={str(tmp_path / "t.sqlite")!r})
        print("dynamo", "torch._dynamo" in sys.modules)
        compiled = torch.compile(model, backend="eager")
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        for i in range(4):
            compiled(torch.randn(4, 8)).pow(2).mean().backward(); opt.step(); opt.zero_grad()
        w.remove()
        from torch._dynamo.utils import counters
        print("frames", counters["frames"]["total"])
        print("rows", len(TraceReader({str(tmp_path / "t.sqlite")!r}).stats(kind="activation")))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = dict(line.split() for line in out.stdout.splitlines())
    assert got["dynamo"] == "False"  # (about a second of import, and sympy's warnings filter)
    assert int(got["frames"]) <= 16  # 13 here; 33 when the hooks were traced (recompiles, up to the limit)
    assert int(got["rows"]) == 4 * 3  # every step, each of the three layers


def test_a_watch_removed_leaves_torch_compile_and_module_pickling_as_they_were(tmp_path):
    compile_before, getstate_before = torch.compile, nn.Module.__dict__["__getstate__"]
    grad_before = torch.autograd.grad
    w = ampdoctor.watch(nn.Linear(2, 2), trace=str(tmp_path / "t.sqlite"))
    assert torch.compile is not compile_before
    w.remove()
    assert torch.compile is compile_before and nn.Module.__dict__["__getstate__"] is getstate_before
    assert torch.autograd.grad is grad_before


def test_a_layer_replaced_after_watch_is_followed_not_reported_stale(tmp_path):
    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.head = nn.Linear(8, 10)

        def forward(self, idx):
            return self.head(self.emb(idx))

    torch.manual_seed(0)
    model = LM()
    real = {}
    with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite")):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(4):
            if step == 2:  # resize_token_embeddings: a new Embedding with 6 more rows
                new = nn.Embedding(16, 8)
                with torch.no_grad():
                    new.weight[:10] = model.emb.weight
                    new.weight[10:] = 1000.0
                model.emb = new
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
            idx = torch.randint(0, 16 if step >= 2 else 10, (4, 3))
            with torch.no_grad():  # (evaluation: not recorded)
                out = model.emb(idx)
            _step(model, opt, idx)
            real[step] = (model.emb.weight.detach().abs().max().item(), out.abs().max().item())
    r = TraceReader(tmp_path / "t.sqlite")
    emb = next(lay["id"] for lay in r.layers() if lay["name"] == "emb")
    weights = {s["step"]: s for s in r.stats(kind="weight") if s["layer"] == emb}
    assert [weights[s]["numel"] for s in range(4)] == [80, 80, 128, 128]
    assert all(weights[s]["absmax"] == np.float32(real[s][0]) for s in range(4))
    acts = {s["step"]: s for s in r.stats(kind="activation") if s["layer"] == emb}
    assert acts[3]["absmax"] == np.float32(real[3][1])
    notes = [e["detail"]["message"] for e in r.events("note")]
    assert any("changed after watch()" in n for n in notes)


def test_a_closure_steps_loss_is_what_step_returns(tmp_path):
    """optimizer.step(closure) (LBFGS) calls the closure, forward and backward, many times: the step's
    loss is the first call's, the one step() returns; a backward before the step still counts."""
    torch.manual_seed(0)
    x = torch.linspace(-3, 3, 64)[:, None]
    y = torch.sin(2 * x)
    model = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.LBFGS(model.parameters(), lr=1, max_iter=10, line_search_fn="strong_wolfe")
    calls = []

    def closure():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        calls.append(loss.item())
        return loss

    path = tmp_path / "t.sqlite"
    returned = []
    with ampdoctor.watch(model, trace=str(path)):
        for _ in range(2):
            returned.append(opt.step(closure).item())
        extra = (model(x) * 0).sum()  # a backward outside any closure, then a closure step: both count
        extra.backward()
        returned.append(opt.step(closure).item() + extra.item())
    assert len(calls) > 6  # (the closure ran several times a step)
    got = [s["loss"] for s in TraceReader(path).steps()]
    assert got == pytest.approx(returned, rel=1e-6), (got, returned)


def test_a_forward_that_raises_leaves_no_rows_in_the_step(tmp_path):
    """A bad batch whose forward raises after its first layer ran, skipped by the loop (or an OOM
    retried): the layers that finished inside it leave no rows or calls in the step that trains
    next. Before, that step showed `a x2` with the aborted batch as its call 0."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 8)
            self.b = nn.Linear(8, 1)

        def forward(self, x):
            h = self.a(x)
            if x.shape[0] == 7:
                raise RuntimeError("bad batch")
            return self.b(h)

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    path = tmp_path / "t.sqlite"
    with ampdoctor.watch(model, trace=str(path)):
        for i in range(4):
            x = torch.randn(7 if i in (1, 2) else 5, 4) * (1e6 if i == 1 else 1.0)  # the bad batch overflows
            try:
                loss = model(x).pow(2).mean()
            except RuntimeError:
                continue
            loss.backward()
            opt.step()
            opt.zero_grad()
    r = TraceReader(path)
    acts = sorted((s["step"], s["call"], s["numel"]) for s in r.stats(kind="activation"))
    assert acts == [(0, 0, 5), (0, 0, 40), (1, 0, 5), (1, 0, 40)], acts
    assert not any(s["overflow"] for s in r.stats())


def test_per_sample_gradients_through_torch_func_are_not_recorded_and_say_so(tmp_path, recwarn):
    """DP-SGD's vmap(grad(functional_call(model, ...))): the calls inside the transform are not
    recorded (their tensors are functorch wrappers: torch warned about batching rules from our
    statistics and errors filled the notes), with one note; the steps still count and the weight
    gradients assigned to .grad are read where each step ends. Training is unchanged."""
    from torch.func import functional_call, grad, vmap

    def train(watch):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        x, y = torch.randn(8, 6), torch.randn(8, 1)
        w = ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite")) if watch else None
        for _ in range(2):
            params = {k: v.detach() for k, v in model.named_parameters()}

            def f(p, xi, yi):
                return nn.functional.mse_loss(functional_call(model, p, (xi[None],)), yi[None])

            psg = vmap(grad(f), in_dims=(None, 0, 0))(params, x, y)
            for k, p in model.named_parameters():
                p.grad = psg[k].mean(0)
            opt.step()
        if w is not None:
            w.remove()
        return [p.detach().clone() for p in model.parameters()]

    want = train(False)
    got = train(True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not [w for w in recwarn if "ampdoctor" in str(w.filename)], [str(w.message) for w in recwarn]
    r = TraceReader(tmp_path / "t.sqlite")
    assert [s["step"] for s in r.steps()] == [0, 1]  # the parent's two, no more
    notes = [e["detail"]["message"] for e in r.events("note")]
    assert sum("torch.func transform" in n for n in notes) == 1 and not any("vmap:" in n for n in notes), notes
    assert {s["kind"] for s in r.stats()} == {"weight", "weight_grad"}


@pytest.mark.parametrize("second_watched", [True, False])
def test_two_models_trained_in_two_threads(tmp_path, second_watched):
    """Two models trained at once in two threads (the second watched too, or not): the hooks are not
    thread-safe, so the session records the thread whose watched model ran first and leaves the other
    alone, with a note. Before: segfaults, NaN counts of INT64_MIN, false first-non-finite events, a
    report that raised, and the other thread's optimizer steps and losses mixed into the steps."""
    import threading

    def make(seed):
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
        return m, torch.optim.SGD(m.parameters(), lr=1e-2), torch.amp.GradScaler("cpu")

    losses = {}

    def train(name, m, o, s, start=None):
        if start is not None:
            start.wait()
        out = losses.setdefault(name, [])
        for _ in range(20):
            x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(m(x), y)
            o.zero_grad()
            s.scale(loss).backward()
            s.step(o)
            s.update()
            out.append(loss.item())

    a, b = make(0), make(1)
    path = tmp_path / "t.sqlite"
    wa = ampdoctor.watch(a[0], trace=str(path))
    wb = ampdoctor.watch(b[0]) if second_watched else None
    started = threading.Event()
    t = threading.Thread(target=train, args=("b", *b, started))
    a[0](torch.randn(1, 32))  # (the main thread's model runs first: it is the one recorded)
    t.start()
    started.set()
    train("a", *a)
    t.join()
    for w in (wa, wb):
        if w is not None:
            w.remove()
    rep = wa.report()
    r = TraceReader(path)
    steps = r.steps()
    assert len(steps) == 20 and [s["loss"] for s in steps] == pytest.approx(losses["a"], rel=1e-3)
    assert all(s["nan"] == 0 and s["posinf"] == 0 for s in r.stats())
    assert not r.events("first_nonfinite") and not rep.diagnosis.broke
    names = {lay["name"] for lay in r.layers() if lay["ord"] is not None}
    assert names == {"", "0", "1", "2"}, names  # model a's layers only (b's, if watched, never ran here)
    notes = [e["detail"]["message"] for e in r.events("note")]
    assert any("runs in another thread" in n for n in notes) == second_watched, notes


def test_watch_of_a_watched_model_warns_about_the_arguments_it_ignores(tmp_path, caplog):
    """watch() of a model already watched returns the existing handle: a trace=, every= or format= that
    differ were dropped with only an info line (the README says it warns)."""
    model = nn.Linear(4, 4)
    w = ampdoctor.watch(model, trace=str(tmp_path / "a.sqlite"), every=1)
    try:
        with caplog.at_level(logging.WARNING, logger="ampdoctor"):
            again = ampdoctor.watch(model, trace=str(tmp_path / "b.sqlite"), every=5, format="bf16")
        assert again is w
        text = caplog.text
        assert "ignoring every=5" in text and "ignoring format='bf16'" in text and "b.sqlite" in text, text
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ampdoctor"):
            ampdoctor.watch(model, trace=str(tmp_path / "a.sqlite"), every=1)
        assert "ignoring" not in caplog.text
    finally:
        w.remove()


def test_a_trace_path_that_cannot_be_written_is_named(tmp_path):
    """watch(trace=) where the trace cannot be made (under a file, a read-only folder): an error that
    names the path and says what to do (it was a bare FileExistsError / sqlite3 "unable to open
    database file"), and the next watch() with a good path records."""
    from ampdoctor.trace import TraceUnwritable

    blocker = tmp_path / "file"
    blocker.write_text("x")
    model = nn.Linear(2, 2)
    with pytest.raises(TraceUnwritable, match=r"cannot write the trace at .*file.*give watch\(trace=\.\.\.\)"):
        ampdoctor.watch(model, trace=str(blocker / "t.sqlite"))
    with ampdoctor.watch(model, trace=str(tmp_path / "ok.sqlite")) as w:
        model(torch.randn(3, 2)).sum().backward()
    assert w.trace_path == str(tmp_path / "ok.sqlite") or str(w.trace_path) == str(tmp_path / "ok.sqlite")
    assert TraceReader(tmp_path / "ok.sqlite").stats()


def test_a_trace_another_live_run_writes_is_refused(tmp_path):
    """A second, separate script's watch(trace=) at the trace of a run still going on added its steps to
    that run's (a warning nobody saw: ampdoctor's logger has no handler). It is refused with the path and
    what to do; a trace whose run ended is replaced, as before."""
    from ampdoctor.trace import TraceUnwritable

    trace = tmp_path / "t.sqlite"
    code = textwrap.dedent(f"""
        import sys, time, torch, ampdoctor
        m = torch.nn.Linear(2, 2)
        w = ampdoctor.watch(m, trace={str(trace)!r})
        m(torch.randn(3, 2)).sum().backward()
        print("ready", flush=True)
        sys.stdin.readline()
        w.remove()
    """)
    other = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "ready"
        model = nn.Linear(2, 2)
        with pytest.raises(TraceUnwritable, match=rf"{trace} is the trace of a run still going on \(process "
                                                  rf"{other.pid} writes it\): give watch\(trace=\.\.\.\)"):
            ampdoctor.watch(model, trace=str(trace))
    finally:
        other.communicate("\n", timeout=60)
    assert TraceReader(trace).meta()["pid"] == other.pid  # its trace, untouched
    # once that run has ended, its trace is replaced, as any old trace is
    model = nn.Linear(2, 2)
    with ampdoctor.watch(model, trace=str(trace)):
        model(torch.randn(3, 2)).sum().backward()
    assert TraceReader(trace).meta()["pid"] != other.pid


def test_a_spawned_dataloader_worker_that_re_runs_the_scripts_watch_leaves_the_trace_alone(tmp_path):
    """A script with watch(trace=...) at its top level and a DataLoader of spawn workers (the default
    on macOS, and forkserver from Python 3.14): each worker re-runs the top level, so its watch() opened
    the training process's live trace and raised sqlite3 "database is locked" from our internals; the
    worker died and so did the training ("DataLoader worker exited unexpectedly"). The worker now writes
    nothing to it; the training records as without workers."""
    trace = tmp_path / "t.sqlite"
    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent(f"""
        import torch, ampdoctor
        model = torch.nn.Linear(4, 4)
        w = ampdoctor.watch(model, trace={str(trace)!r})

        class DS(torch.utils.data.Dataset):
            def __len__(self):
                return 8
            def __getitem__(self, i):
                return torch.full((4,), float(i))

        if __name__ == "__main__":
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            for x in torch.utils.data.DataLoader(DS(), batch_size=4, num_workers=1, multiprocessing_context="spawn"):
                opt.zero_grad(); model(x).sum().backward(); opt.step()
            w.remove()
            print("trained", flush=True)
    """))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0 and "trained" in p.stdout, p.stderr
    assert "Traceback" not in p.stderr and "ampdoctor" not in p.stderr, p.stderr
    r = TraceReader(trace)
    assert r.meta()["status"] == "finished" and r.meta()["pid"] != 0
    assert [s["step"] for s in r.steps()] == [0, 1]


def test_a_child_that_trains_into_its_parents_live_trace_is_told_its_steps_are_not_recorded(tmp_path):
    """A process the training process started that trains a watched model into the parent's live trace:
    its rows would mix with the parent's (and its meta, pid and status, overwrite the parent's); they are
    not written, and it is told so on stderr, once, with what to do."""
    trace = tmp_path / "t.sqlite"
    child = textwrap.dedent(f"""
        import torch, ampdoctor
        m = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        with ampdoctor.watch(m, trace={str(trace)!r}):
            for _ in range(3):
                opt.zero_grad(); m(torch.randn(3, 2)).sum().backward(); opt.step()
    """)
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ampdoctor.watch(model, trace=str(trace)):
        for i in range(2):
            opt.zero_grad()
            model(torch.randn(3, 2)).sum().backward()
            opt.step()
            if i == 0:
                p = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("ampdoctor:") == 1, p.stderr
    assert (f"trains a watched model, but {trace} is the trace of the process that started it ({os.getpid()}); this "
            "process's steps are not recorded: give its watch() its own trace=... path") in p.stderr.replace("\n", " ")
    r = TraceReader(trace)
    assert r.meta()["pid"] == os.getpid() and r.meta()["status"] == "finished"
    assert [s["step"] for s in r.steps()] == [0, 1]  # the parent's two, no more


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_sparse_embedding_gradient_is_measured_by_the_values_it_holds(tmp_path, device):
    """``nn.Embedding(sparse=True)`` under fp16 autocast and a GradScaler whose scale overflows fp16:
    the embedding's weight gradient is a sparse COO tensor, uncoalesced (a token seen twice in a batch
    has two entries). Its row holds the statistics of the dense gradient's rows that the batch touched
    (repeated tokens summed), checked against numpy on the dense gradient, counts exact, the histogram
    included; a note says what the row measures. (It had no row at all: sparse gradients were left out.)"""
    from numpy_ref import reference_stats

    from ampdoctor.formats import get_format

    torch.manual_seed(0)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 8, sparse=True)
            self.fc = nn.Linear(8, 3)

        def forward(self, x):
            return self.fc(self.emb(x).mean(1))

    m = M().to(device)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 22, growth_interval=1)
    refs, dupes = [], 0
    trace = tmp_path / "t.sqlite"
    with ampdoctor.watch(m, trace=str(trace)):
        for _ in range(6):
            x, y = torch.randint(0, 50, (6, 5), device=device), torch.randint(0, 3, (6,), device=device)
            with torch.autocast(device, dtype=torch.float16):
                loss = nn.functional.cross_entropy(m(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            g = m.emb.weight.grad
            assert g.layout == torch.sparse_coo
            rows = np.unique(x.cpu().numpy())
            dupes += x.numel() > rows.size
            refs.append(g.to_dense().cpu().numpy().astype(np.float64)[rows])
            scaler.step(opt)
            scaler.update()
    assert dupes  # (some batch repeated a token: its entries are summed)
    fmt = get_format("fp16")
    r = TraceReader(trace)
    lid = {row["name"]: row["id"] for row in r.layers()}["emb"]
    got = [s for s in r.stats(kind="weight_grad", layer=lid, with_hist=True)]
    assert [s["step"] for s in got] == list(range(6))
    overflow = 0
    for s, ref_values in zip(got, refs):
        ref = reference_stats(ref_values, fmt)
        assert s["slot"] == "weight" and s["dtype"] == "float32"
        for key, val in ref.items():
            assert (list(s[key]) if key == "hist" else s[key]) == val, (s["step"], key)
        overflow += ref["overflow"] + ref["posinf"] + ref["neginf"]
    assert overflow  # (the scale made some of them too large for fp16: the counts are not all zero)
    notes = [e["detail"]["message"] for e in r.events("note") if e["layer"] == "emb"]
    assert len(notes) == 1 and "sparse" in notes[0]


def test_spawned_children_that_re_run_a_top_level_watch_make_a_trace_only_if_they_train(tmp_path):
    """A script whose top level calls ``watch(model)`` with no trace path, then a DataLoader of a
    spawn worker (macOS's default start method; forkserver, Python 3.14's on Linux, re-runs the top level
    too), then a spawned process that trains the model it re-created. Each DataLoader worker re-ran the
    watch(): it made a temporary trace, started a writer process and printed "recording to" on stderr,
    for a process that only loads data. Now only the processes that train make a trace and say where:
    the script's own and the training child's, whose trace holds its steps."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent("""
        import multiprocessing as mp, torch, ampdoctor
        model = torch.nn.Linear(4, 4)
        w = ampdoctor.watch(model)

        class DS(torch.utils.data.Dataset):
            def __len__(self):
                return 8
            def __getitem__(self, i):
                return torch.full((4,), float(i))

        def train(steps):
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            for _ in range(steps):
                opt.zero_grad(); model(torch.randn(2, 4)).sum().backward(); opt.step()
            w.remove()
            print("child trace", w.trace_path, flush=True)

        if __name__ == "__main__":
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            for x in torch.utils.data.DataLoader(DS(), batch_size=4, num_workers=1, multiprocessing_context="spawn"):
                opt.zero_grad(); model(x).sum().backward(); opt.step()
            p = mp.get_context("spawn").Process(target=train, args=(3,))
            p.start(); p.join()
            assert p.exitcode == 0
            w.remove()
            print("parent trace", w.trace_path, flush=True)
    """))
    env = {**os.environ, "TMPDIR": str(tmp)}
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    said = [line for line in p.stderr.splitlines() if line.startswith("ampdoctor: recording to ")]
    assert len(said) == 2, p.stderr  # (the script and the training child; not the worker)
    paths = dict(line.split(" trace ") for line in p.stdout.splitlines() if " trace " in line)
    made = sorted(str(q) for q in tmp.glob("ampdoctor-*/trace.sqlite"))
    assert made == sorted(paths.values())
    assert [s["step"] for s in TraceReader(paths["parent"]).steps()] == [0, 1]
    assert [s["step"] for s in TraceReader(paths["child"]).steps()] == [0, 1, 2]
    assert len(list(tmp.glob("ampdoctor-*"))) == 2  # (no empty folder left by a worker)
