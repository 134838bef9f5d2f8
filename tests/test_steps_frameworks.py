"""Where a recorded step ends with several optimizers (a GAN's D and G) and with Lightning: one
step of the trace is one iteration of the training loop, holding every optimizer's update of it."""

import collections
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.trace import TraceReader

ROOT = Path(__file__).resolve().parents[1]
ITERS = 15


def _gan(tmp_path, scaler_mode, iters=ITERS, watch_g=True):
    """A GAN loop: D's backward and step, then G's backward and step, every iteration. ``scaler_mode``:
    None (no GradScaler), "once" (one update() per iteration, after both steps), "each" (an
    update() after each optimizer's step, as Lightning's 16-mixed plugin does with two optimizers).
    Returns the trace, and per iteration: the losses' sum, the optimizer steps so far, G's and D's
    largest |weight| after the iteration, the scale after it."""
    torch.manual_seed(0)
    g = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    d = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    og, od = torch.optim.SGD(g.parameters(), lr=0.05), torch.optim.SGD(d.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4) if scaler_mode else None
    path = tmp_path / f"gan_{scaler_mode}.sqlite"
    expect = []
    with ampdoctor.watch(g if watch_g else d, trace=str(path)), ampdoctor.watch(d):
        for _ in range(iters):
            real, z = torch.randn(16, 4), torch.randn(16, 4)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=scaler is not None):
                fake = g(z)
                ld = (d(real).float() - 1).pow(2).mean() + d(fake.detach()).float().pow(2).mean()
            od.zero_grad()
            if scaler is None:
                ld.backward()
                od.step()
            else:
                scaler.scale(ld).backward()
                scaler.step(od)
                if scaler_mode == "each":
                    scaler.update()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=scaler is not None):
                lg = (d(g(z)).float() - 1).pow(2).mean()
            og.zero_grad()
            if scaler is None:
                lg.backward()
                og.step()
            else:
                scaler.scale(lg).backward()
                scaler.step(og)
                scaler.update()
            with torch.no_grad():
                wmax = {name: max(p.abs().max().item() for p in m.parameters()) for name, m in (("g", g), ("d", d))}
            expect.append((ld.item() + lg.item(), wmax, None if scaler is None else scaler.get_scale()))
    return TraceReader(path), expect


@pytest.mark.parametrize("scaler_mode", [None, "once", "each"])
def test_a_gan_step_is_one_iteration_of_both_optimizers(tmp_path, scaler_mode):
    """15 iterations are 15 steps, each holding D's and G's work of one iteration: its loss is the
    sum of both losses, every module call of the iteration is in it once (D runs three times, G
    twice), and its weight rows are the weights after both updates. (The old rule ended a step at
    each step of the first optimizer: 16 steps without a GradScaler, the first D's alone and the others
    G's of one iteration with D's of the next; with an update() after each optimizer, 30.)"""
    r, expect = _gan(tmp_path, scaler_mode)
    steps = r.steps()
    assert [s["step"] for s in steps] == list(range(ITERS))
    assert r.meta()["optimizer_steps"] >= 2 * ITERS - 2  # (a skipped step of a GradScaler is no optimizer step)
    names = {lay["id"]: lay["name"] for lay in r.layers()}
    stats = r.stats()
    for k, (s, (loss, wmax, scale)) in enumerate(zip(steps, expect)):
        assert s["loss"] == pytest.approx(loss, rel=1e-6), k
        if scale is not None:
            assert s["scale"] == scale, k
        acts = collections.Counter((names[x["layer"]], x["slot"], x["call"]) for x in stats
                                   if x["step"] == k and x["kind"] == "activation")
        assert all(n == 1 for n in acts.values()), (k, acts)  # no call number twice
        calls = collections.defaultdict(set)
        for name, _, call in acts:
            calls[name].add(call)
        assert calls["Sequential:2"] == {0, 1, 2} and calls["2"] == {0, 1}, (k, dict(calls))
        weights = [x for x in stats if x["step"] == k and x["kind"] == "weight"]
        assert len(weights) == 8, k  # 4 parameters each, once
        for who, prefix in (("g", ""), ("d", "Sequential:")):
            got = max(x["absmax"] for x in weights if names[x["layer"]].startswith(prefix) and
                      (prefix or not names[x["layer"]].startswith("Sequential:")))
            assert got == pytest.approx(wmax[who], rel=1e-6), (k, who)
    assert [s["optimizer_steps"] for s in steps][-1] == r.meta()["optimizer_steps"]
    if scaler_mode is None:
        assert [s["optimizer_steps"] for s in steps] == [2 * (k + 1) for k in range(ITERS)]


def test_one_optimizer_steps_and_a_gan_of_one_iteration(tmp_path):
    """One optimizer: a step per optimizer step from the first (the round is learnt at the second,
    step 0 is written then). A GAN run of a single iteration ends with its one step, D's and G's."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    losses = []
    with ampdoctor.watch(m, trace=str(tmp_path / "one.sqlite")):
        for _ in range(3):
            loss = m(torch.randn(8, 4)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    r = TraceReader(tmp_path / "one.sqlite")
    assert [(s["step"], s["optimizer_steps"]) for s in r.steps()] == [(0, 1), (1, 2), (2, 3)]
    assert [s["loss"] for s in r.steps()] == pytest.approx(losses, rel=1e-6)

    r, expect = _gan(tmp_path, None, iters=1)
    assert [(s["step"], s["optimizer_steps"]) for s in r.steps()] == [(0, 2)]
    assert r.steps()[0]["loss"] == pytest.approx(expect[0][0], rel=1e-6)


def test_a_gan_with_only_d_watched(tmp_path):
    """watch(d) alone: D's optimizer holds every watched parameter, so its first step ends step 0 at
    once; G's step after it ends step 1 (the README says so), and from step 2 on a step is one
    iteration of both."""
    r, expect = _gan(tmp_path, None, watch_g=False)
    steps = r.steps()
    assert [s["optimizer_steps"] for s in steps] == [1, 2] + [2 * (k + 1) for k in range(1, ITERS)]
    assert [s["loss"] for s in steps[2:]] == pytest.approx([e[0] for e in expect[1:]], rel=1e-6)


@pytest.mark.parametrize("order", ["watched_first", "other_first"])
@pytest.mark.parametrize("scalers", [False, True])
@pytest.mark.parametrize("every", [1, 3])
def test_another_models_training_in_the_same_loop_is_not_this_runs(tmp_path, order, scalers, every):
    """watch(a) while b, a separate network with its own loss and optimizer (and GradScaler), trains in
    the same loop: b's steps are not steps of the run and its loss is not in a's (they added a step
    and b's loss of 100 to every step of a's)."""
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    b = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 1))
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.01), torch.optim.SGD(b.parameters(), lr=0.01)
    sa, sb = (torch.amp.GradScaler("cpu", init_scale=2.0 ** 8), torch.amp.GradScaler("cpu", init_scale=2.0 ** 3)) if scalers else (None, None)
    losses = []

    def train_one(model, opt, scaler, x, extra):
        loss = model(x).pow(2).mean() + extra
        opt.zero_grad()
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        return loss.item()

    with ampdoctor.watch(a, trace=str(tmp_path / "t.sqlite"), every=every):
        for _ in range(7):
            x = torch.randn(4, 8)
            if order == "other_first":
                train_one(b, ob, sb, x, 100.0)
            losses.append(train_one(a, oa, sa, x, 0.0))
            if order == "watched_first":
                train_one(b, ob, sb, x, 100.0)
    steps = TraceReader(tmp_path / "t.sqlite").steps()
    assert [s["step"] for s in steps] == list(range(7))
    assert [s["loss"] for s in steps] == pytest.approx(losses, rel=1e-6)
    assert [s["optimizer_steps"] for s in steps] == list(range(1, 8))
    if scalers:
        assert {s["scale"] for s in steps} == {2.0 ** 8}


@pytest.mark.parametrize("pattern", ["shared_scaler", "shared_scaler_both_backwards_first", "both_backwards_first",
                                     "both_backwards_first_other_first"])
def test_another_models_loss_is_not_in_the_step_when_their_work_interleaves(tmp_path, pattern):
    """watch(a) while b (its own loss and optimizer, no parameter of a) trains in the same iteration,
    its work interleaved with a's: one GradScaler for both (PyTorch's AMP recipe for several models),
    or both backward passes before both optimizer steps. The step's loss is a's alone (it held b's 100
    too), one step per iteration."""
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    b = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 1))
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.01), torch.optim.SGD(b.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if pattern.startswith("shared_scaler") else None
    losses = []
    with ampdoctor.watch(a, trace=str(tmp_path / "t.sqlite")):
        for _ in range(6):
            x = torch.randn(4, 8)
            la = a(x).pow(2).mean()
            lb = b(x).pow(2).mean() + 100.0
            oa.zero_grad()
            ob.zero_grad()
            if pattern == "shared_scaler":
                scaler.scale(la).backward()
                scaler.step(oa)
                scaler.scale(lb).backward()
                scaler.step(ob)
                scaler.update()
            elif pattern == "shared_scaler_both_backwards_first":
                scaler.scale(lb).backward()
                scaler.scale(la).backward()
                scaler.step(ob)
                scaler.step(oa)
                scaler.update()
            elif pattern == "both_backwards_first":
                la.backward()
                lb.backward()
                ob.step()
                oa.step()
            else:
                lb.backward()
                la.backward()
                oa.step()
                ob.step()
            losses.append(la.item())
    steps = TraceReader(tmp_path / "t.sqlite").steps()
    assert [s["step"] for s in steps] == list(range(6))
    assert [s["loss"] for s in steps] == pytest.approx(losses, rel=1e-6)


@pytest.mark.parametrize("case", ["frozen_backbone", "watched_teacher"])
def test_an_optimizer_of_unwatched_parameters_is_the_runs_when_nothing_else_trains(tmp_path, case):
    """watch(backbone) with the backbone frozen and only a new head optimized, or watch(teacher) while a
    student learns from its outputs: no optimizer holds a trainable watched parameter that steps, so the
    other optimizer's steps are the run's steps (with a teacher that requires grad, from its second)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
    head = nn.Linear(16 if case == "frozen_backbone" else 8, 1)
    if case == "frozen_backbone":
        net.requires_grad_(False)
    opt = torch.optim.SGD(head.parameters(), lr=0.01)
    losses = []
    with ampdoctor.watch(net, trace=str(tmp_path / "t.sqlite")):
        for _ in range(6):
            x = torch.randn(4, 8)
            if case == "frozen_backbone":
                loss = head(net(x)).pow(2).mean()
            else:
                with torch.no_grad():
                    target = net(x).sum(1, keepdim=True)
                loss = (head(x) - target).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    steps = TraceReader(tmp_path / "t.sqlite").steps()
    if case == "frozen_backbone":
        assert [s["loss"] for s in steps] == pytest.approx(losses, rel=1e-6)
        assert [s["optimizer_steps"] for s in steps] == list(range(1, 7))
    else:  # the first step of the student is taken for another model's, the rest are the run's
        assert [s["loss"] for s in steps][1:] == pytest.approx(losses[2:], rel=1e-6)
        assert len(steps) == 5


def test_a_replaced_optimizer_ends_steps_as_the_old_one_did(tmp_path):
    """The optimizer re-created every few iterations (a restart): each of its steps still ends a step."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with ampdoctor.watch(m, trace=str(tmp_path / "t.sqlite")):
        for i in range(8):
            if i % 3 == 0:
                opt = torch.optim.SGD(m.parameters(), lr=0.1)
            m(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    r = TraceReader(tmp_path / "t.sqlite")
    assert [s["optimizer_steps"] for s in r.steps()] == list(range(1, 9))


class _StepModule(nn.Module):
    """A module whose forward is the whole training step (Lightning's training_step called through the
    DDP wrapper is one): its forward hooks run after the optimizer step has ended the step."""

    def __init__(self, returns_loss):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.opt = torch.optim.SGD(self.net.parameters(), lr=0.01)
        self.returns_loss = returns_loss

    def forward(self, x):
        loss = self.net(x).pow(2).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return loss.detach() if self.returns_loss else None


@pytest.mark.parametrize("returns_loss", [False, True])
def test_no_empty_last_step_after_a_call_that_ends_past_the_step(tmp_path, returns_loss):
    """12 calls of such a module, an evaluation forward under no_grad after the last, then the watch
    removed: 12 steps, each with its loss and rows (the old code wrote a 13th, empty, at remove())."""
    torch.manual_seed(0)
    m = _StepModule(returns_loss)
    path = tmp_path / "t.sqlite"
    with ampdoctor.watch(m, trace=str(path)):
        for _ in range(12):
            m(torch.randn(8, 4))
        with torch.no_grad():
            m.net(torch.randn(8, 4))
    r = TraceReader(path)
    steps = r.steps()
    assert [(s["step"], s["optimizer_steps"]) for s in steps] == [(k, k + 1) for k in range(12)]
    assert all(s["loss"] is not None for s in steps)
    assert {x["step"] for x in r.stats()} == set(range(12))


def test_a_call_that_ends_past_the_step_records_no_output_into_the_next(tmp_path):
    """All modules watched: the outer module's output, returned after its own optimizer step, is not
    put into the next step's rows (the old code wrote step k's output as step k+1's, and a 5th step
    holding only the last output); its inner layers' rows stay in their steps; a note says why."""
    torch.manual_seed(0)
    m = _StepModule(True)
    path = tmp_path / "t.sqlite"
    with ampdoctor.watch(m, trace=str(path), all_modules=True):
        for _ in range(4):
            m(torch.randn(8, 4))
    r = TraceReader(path)
    assert [(s["step"], s["optimizer_steps"]) for s in r.steps()] == [(k, k + 1) for k in range(4)]
    root = next(x["id"] for x in r.layers() if x["name"] == "")
    net = next(x["id"] for x in r.layers() if x["name"] == "net")
    rows = r.stats()
    assert not [x for x in rows if x["layer"] == root]
    assert sorted(x["step"] for x in rows if x["layer"] == net and x["kind"] == "activation") == [0, 1, 2, 3]
    notes = [e for e in r.events("note") if "optimizer step that ends" in e["detail"].get("message", "")]
    assert len(notes) == 1


def test_a_last_backward_without_an_optimizer_step_is_still_a_partial_step(tmp_path):
    """What trained after the last optimizer step (a gradient-accumulation remainder) is still written."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    with ampdoctor.watch(m, trace=str(tmp_path / "t.sqlite"), every=2):
        for i in range(4):
            loss = m(torch.randn(8, 4)).pow(2).mean()
            loss.backward()
            if i < 3:
                opt.step()
                opt.zero_grad()
    r = TraceReader(tmp_path / "t.sqlite")
    assert [s["step"] for s in r.steps()] == [0, 1, 2, 3]
    assert r.steps()[3]["loss"] == pytest.approx(loss.item(), rel=1e-6)  # (step 3 is not recorded: no rows)


_LIGHTNING = r'''
import os, sys, torch, torch.nn as nn, lightning as L, ampdoctor
from torch.utils.data import DataLoader, TensorDataset

class GAN(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.g = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
        self.d = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    def training_step(self, batch, i):
        od, og = self.optimizers()
        real = batch[0]
        z = torch.randn_like(real)
        self.toggle_optimizer(od)
        ld = (self.d(real) - 1).pow(2).mean() + self.d(self.g(z).detach()).pow(2).mean()
        od.zero_grad(); self.manual_backward(ld); od.step()
        self.untoggle_optimizer(od)
        self.toggle_optimizer(og)
        lg = (self.d(self.g(z)) - 1).pow(2).mean()
        og.zero_grad(); self.manual_backward(lg); og.step()
        self.untoggle_optimizer(og)
    def validation_step(self, batch, i):
        self.log("v", self.d(batch[0]).mean(), sync_dist=True)
    def configure_optimizers(self):
        return [torch.optim.SGD(self.d.parameters(), lr=0.01), torch.optim.SGD(self.g.parameters(), lr=0.01)]

if __name__ == "__main__":
    out, precision, devices = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.manual_seed(0)
    model = GAN()
    w = ampdoctor.watch(model, trace=os.path.join(out, "trace.sqlite"))
    data = TensorDataset(torch.randn(96, 4))
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy="ddp_find_unused_parameters_true" if devices > 1 else "auto",
                        precision=precision, max_epochs=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, val_check_interval=3)
    trainer.fit(model, DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))
    w.remove()
'''


@pytest.mark.slow
@pytest.mark.parametrize("precision,devices", [("32", 1), ("16-mixed", 1), ("32", 2)])
def test_lightning_manual_optimization_with_two_optimizers(tmp_path, precision, devices):
    """Lightning, manual optimization, two optimizers (Lightning's 16-mixed calls update() after each
    optimizer's step), validation after the last training step; with DDP (gloo, two ranks) each rank's
    trace. A step per training_step: 24 with one process, 12 each with two."""
    pytest.importorskip("lightning")
    script = tmp_path / "gan_lightning.py"
    script.write_text(_LIGHTNING)
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "AMPDOCTOR_CONFIG"}
    p = subprocess.run([sys.executable, str(script), str(out), precision, str(devices)], capture_output=True,
                       text=True, cwd=tmp_path, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    per_rank = 24 // devices  # 96 samples, batches of 8, two epochs
    paths = [out / "trace.sqlite"] + [out / f"trace.rank{k}.sqlite" for k in range(1, devices)]
    for path in paths:
        r = TraceReader(path)
        steps = r.steps()
        assert [s["step"] for s in steps] == list(range(per_rank)), path
        assert all(s["loss"] is not None and math.isfinite(s["loss"]) for s in steps), path
        if precision == "32":
            assert [s["optimizer_steps"] for s in steps] == [2 * (k + 1) for k in range(per_rank)], path
