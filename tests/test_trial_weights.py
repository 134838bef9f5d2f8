"""A trial's weights are checked for NaN/Inf at every step while an oracle decides, also on the steps
a search trial does not record (its rows: step 0 and the steps after a non-finite loss)."""

import json
import math

import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.bisect.trials import LITE_EVERY
from ampdoctor.config import RunConfig
from ampdoctor.session import Session, StopRun


class _Net(nn.Module):
    def __init__(self, spare: float = 0.0):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.spare = nn.Linear(2, 1, bias=False)  # never called: only its weight matters
        with torch.no_grad():
            self.spare.weight.fill_(spare)

    def forward(self, x):
        return self.net(x)


def _train(monkeypatch, tmp_path, model, steps=12, break_at=None, value=math.nan, every=LITE_EVERY, oracle=True,
           pass_after=None, device="cpu"):
    """Train ``model`` under a trial-like config; at ``break_at`` the update writes ``value`` into one
    weight (as an fp16 backward that overflowed does) while the step's loss stays finite. Returns the
    session's decision, or None."""
    cfg = RunConfig(trace=str(tmp_path / "t.sqlite"), format="fp16", every=every, oracle={} if oracle else None,
                    pass_after=pass_after)
    monkeypatch.setenv("AMPDOCTOR_CONFIG", json.dumps(cfg.__dict__))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    dtype = next(model.parameters()).dtype
    gen = torch.Generator().manual_seed(1)
    w = ampdoctor.watch(model)
    session = w.session
    try:
        for step in range(steps):
            x = torch.randn(8, 4, generator=gen).to(device=device, dtype=dtype)
            loss = model(x).float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            if step == break_at:
                with torch.no_grad():
                    model.net[2].weight[0, 3] = value
            opt.step()
    except StopRun:
        pass
    finally:
        w.remove()
    return session.decision


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, "mixed"])
def test_unrecorded_step_whose_update_broke_the_weights_fails_there(monkeypatch, tmp_path, value, dtype):
    """The loss of step 5 is finite, the weights after its update are not: nonfinite_params at 5 (a search
    trial said 6: it saw the weights only on step 7, recorded after the NaN loss of step 6). ``mixed``: an
    fp32 model with an fp64 and an fp16 weight beside."""
    model = _Net()
    if dtype == "mixed":
        model.spare.double()
        model.add_module("spare16", nn.Linear(2, 2).half())  # (not called either)
    else:
        model.to(dtype)
    d = _train(monkeypatch, tmp_path, model, break_at=5, value=value)
    assert (d.outcome, d.step, d.reason) == ("fail", 5, "nonfinite_params")


@pytest.mark.cuda
@pytest.mark.parametrize("nvrtc", [True, False])
@pytest.mark.parametrize("value", [math.nan, math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_unrecorded_step_whose_update_broke_the_weights_fails_there_on_cuda(monkeypatch, tmp_path, value, dtype,
                                                                           nvrtc):
    """The same on a CUDA model (the NVRTC flags kernel, one launch for all the weights; without NVRTC,
    the sums), and a healthy CUDA trial passes."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if not nvrtc:
        from ampdoctor import stats_cuda
        monkeypatch.setattr(stats_cuda, "flags_backend", lambda dev: False)
    d = _train(monkeypatch, tmp_path, _Net().to("cuda", dtype), break_at=5, value=value, device="cuda")
    assert (d.outcome, d.step, d.reason) == ("fail", 5, "nonfinite_params")
    d = _train(monkeypatch, tmp_path, _Net().to("cuda", dtype), steps=12, pass_after=10, device="cuda")
    assert (d.outcome, d.reason) == ("pass", None), d


def test_weights_whose_sum_overflows_are_finite(monkeypatch, tmp_path):
    """A finite weight of 3e38, twice: its fp32 sum is Inf (the cheap check's false alarm), the exact
    check says finite, and the trial passes."""
    assert torch.full((1, 2), 3e38).sum().item() == math.inf
    d = _train(monkeypatch, tmp_path, _Net(spare=3e38), steps=12, pass_after=10)
    assert (d.outcome, d.reason) == ("pass", None), d
    d = _train(monkeypatch, tmp_path, _Net(spare=3e38), break_at=4)
    assert (d.outcome, d.step, d.reason) == ("fail", 4, "nonfinite_params")


@pytest.mark.parametrize("every, oracle, calls", [(LITE_EVERY, True, 9), (1, True, 0), (LITE_EVERY, False, 0),
                                                  (1, False, 0)])
def test_the_weights_are_screened_only_where_an_oracle_has_no_weight_rows(monkeypatch, tmp_path, every, oracle, calls):
    """Steps 1..9 of a search trial (step 0 is recorded); none in a run without an oracle (``watch()``,
    ``ampdoctor run``), nor in a trial that records every step (its weight rows say it)."""
    seen = []
    screen = Session._params_screen

    def counting(self):
        seen.append(self.step)
        return screen(self)

    monkeypatch.setattr(Session, "_params_screen", counting)
    _train(monkeypatch, tmp_path, _Net(), steps=10, every=every, oracle=oracle)
    assert seen == list(range(1, 1 + calls))


@pytest.mark.parametrize("bad,expect", [
    ({8, 9, 10}, ("fail", 8, "nonfinite_loss")),   # the streak went on past the horizon: a failure
    ({8, 9}, ("pass", 10, None)),                   # it ended there: the trial passes, one step late
])
def test_a_trial_is_not_passed_in_the_middle_of_a_nan_streak(monkeypatch, tmp_path, bad, expect):
    """pass_after=10: the trial is judged once step 9 ran. Its losses at 8 and 9 were NaN (two, one short of
    the three in a row that fail), and the trial passed there although it ended on NaN losses: bisect called a
    layer set a fix whose run was still breaking. Now it runs on until the streak ends or fails."""
    cfg = RunConfig(trace=str(tmp_path / "t.sqlite"), format="fp16", every=LITE_EVERY, oracle={}, pass_after=10)
    monkeypatch.setenv("AMPDOCTOR_CONFIG", json.dumps(cfg.__dict__))
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    gen = torch.Generator().manual_seed(1)
    w = ampdoctor.watch(model)
    session = w.session
    ran = 0
    try:
        for step in range(30):
            loss = model(torch.randn(8, 4, generator=gen)).float().pow(2).mean()
            if step in bad:
                loss = loss * math.inf  # (its gradients are NaN/Inf: the GradScaler skips the step)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            ran += 1
    except StopRun:
        pass
    finally:
        w.remove()
    d = session.decision
    assert (d.outcome, d.step, d.reason)[:len(expect)] == expect, d
    assert ran == 10, ran  # (stopped at step 10, where it was judged; it stopped at 9)
