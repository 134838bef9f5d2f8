"""Batched measuring (ampdoctor.rows): the trace is the same as measuring each tensor in its hook,
also when tensors change in place after their hook (user code, in-place modules, GradScaler)."""

import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor import rows as rows_mod
from ampdoctor.trace import TraceReader


class Res(nn.Module):
    """In-place changes after a hook: ReLU(inplace=True) after a Linear, ``out += x`` in user code."""

    def __init__(self, inplace_from: int = 0):
        super().__init__()
        self.lin1 = nn.Linear(8, 8)
        self.act = nn.ReLU(inplace=True)
        self.lin2 = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 1)
        self.calls = 0
        self.inplace_from = inplace_from

    def forward(self, x):
        self.calls += 1
        h = self.act(self.lin1(x))
        out = self.lin2(h)
        if self.calls > self.inplace_from:
            out += 1.5  # changes lin2's recorded output in place
        return self.head(self.norm(out))


def _train(model, steps, micro=2):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sc = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        for _ in range(micro):  # gradient accumulation: the 2nd backward adds to .grad in place
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 8, generator=g) * 3).float().pow(2).mean()
            sc.scale(loss).backward()
        sc.unscale_(opt)  # changes every .grad in place
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        sc.step(opt)
        sc.update()
        opt.zero_grad()


def _record(tmp_path, name, monkeypatch, *, eager, budget=None, steps=4, **kw):
    monkeypatch.setattr(rows_mod, "EAGER", eager)
    if budget is not None:
        monkeypatch.setattr(rows_mod, "BUDGET_BYTES", budget)
    torch.manual_seed(0)
    model = Res(**kw)
    path = tmp_path / f"{name}.sqlite"
    with ampdoctor.watch(model, trace=str(path)):
        _train(model, steps)
    r = TraceReader(path)
    key = lambda s: (s["step"], s["layer"], s["kind"], s["slot"], s["call"])  # noqa: E731
    return sorted(r.stats(), key=key), r


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x == y


@pytest.mark.parametrize("budget", [None, 1])
def test_batched_equals_eager(tmp_path, monkeypatch, budget):
    ref, _ = _record(tmp_path, "eager", monkeypatch, eager=True)
    got, r = _record(tmp_path, "batched", monkeypatch, eager=False, budget=budget)
    _same(ref, got)
    assert not [e for e in r.events() if "changed in place" in str(e)]
    kinds = {s["kind"] for s in got}
    assert kinds == {"activation", "gradient", "weight", "weight_grad"}


def test_weight_grads_are_read_before_unscale(tmp_path, monkeypatch):
    got, _ = _record(tmp_path, "b", monkeypatch, eager=False, steps=3)
    wg = [s for s in got if s["kind"] == "weight_grad" and s["step"] == 2]
    # the scaled gradient (scale 65536): far larger than after unscale_ and clipping to norm 0.1
    assert wg and max(s["absmax"] for s in wg) > 100


def test_change_in_place_only_later_is_dropped_not_wrong(tmp_path, monkeypatch):
    ref, _ = _record(tmp_path, "eager", monkeypatch, eager=True, inplace_from=4, steps=4)
    got, r = _record(tmp_path, "batched", monkeypatch, eager=False, inplace_from=4, steps=4)
    names = {lay["id"]: lay["name"] for lay in r.layers()}
    missing = [s for s in ref if s not in got]
    # step 2 (forward calls 5 and 6) changes lin2's output for the first time: not written, noted
    assert missing and all(names[s["layer"]] == "lin2" and s["kind"] == "activation" and s["step"] == 2
                           for s in missing)
    assert [s for s in got if s not in ref] == []
    assert any("changed in place" in str(e) for e in r.events())
    later = [s for s in got if s["step"] == 3 and names[s["layer"]] == "lin2" and s["kind"] == "activation"]
    assert len(later) == 2  # measured in the hook from then on


def test_flags_cost_no_kernel_of_their_own(tmp_path, monkeypatch):
    calls, checks = [], []
    real, real_nf = rows_mod._stats.batch_stats, rows_mod._stats.batch_nonfinite
    monkeypatch.setattr(rows_mod._stats, "batch_stats", lambda ts, fmt: calls.append(len(ts)) or real(ts, fmt))
    monkeypatch.setattr(rows_mod._stats, "batch_nonfinite", lambda ts: checks.append(len(ts)) or real_nf(ts))
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 1))
    with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite")) as w:
        _train(model, 1, micro=1)  # step 0: calibration, every tensor measured in its hook
        assert w.session.attributing
        calls.clear()
        _train(model, 1, micro=1)
    r = TraceReader(tmp_path / "t.sqlite")
    step1 = [s for s in r.stats() if s["step"] == 1]
    # one launch at the end of backward, one for the weights at the step boundary; every flag is
    # read off a row; the model's input, measured for a flag alone, gets the gated check, which
    # reads nothing on a step without NaN/Inf
    assert len(calls) == 2
    assert sum(calls) == len(step1)
    assert checks == []


def test_batch_past_budget_grows_only_under_the_peak(monkeypatch):
    """A batch past its budget is let grow (no flush) while allocated memory plus a budget stays
    under the first recorded step's peak, and is flushed once it would not, or once it holds a
    quarter of that peak; rows are the same either way."""
    from ampdoctor.formats import get_format
    allocated = {"now": 0}
    monkeypatch.setattr(rows_mod, "_allocated", lambda d: allocated["now"])
    pol = rows_mod.RowPolicy(get_format("fp16"), budget=400)
    pol.calibrated = True
    pol.peaks = {torch.device("cuda", 0): 10_000}
    assert pol.room(1000)
    allocated["now"] = 9_300
    assert not pol.room(1000)                 # 9300 + a step (2 x 400) > 10000
    allocated["now"] = 0
    assert not pol.room(2_600)                # more than a quarter of the peak
    step = rows_mod.StepRows(pol)
    ts = [torch.full((25,), float(i + 1)) for i in range(40)]  # 100 bytes each
    for i, t in enumerate(ts[:20]):
        step.add_row(("m", i, 100), t, ("k", i))
    assert not step.blocks and len(step._pending) == 20    # 2000 bytes past a 400-byte budget
    allocated["now"] = 9_300
    n = 20
    while not step.blocks:                                 # the next look (within a step) flushes
        step.add_row(("m", n, 100), ts[n], ("k", n))
        n += 1
    assert n - 20 <= pol.step // 100 + 1 and not step._pending
    step.finish()
    table = step.host_table([b.numpy() for b in step.device_pieces()], step.blocks[0][0].shape[1])
    assert [row[6] for row in table] == [float(i + 1) for i in range(n)]  # max of each tensor


def test_without_peaks_a_batch_flushes_at_its_budget():
    from ampdoctor.formats import get_format
    pol = rows_mod.RowPolicy(get_format("fp16"), budget=250)
    pol.calibrated = True
    step = rows_mod.StepRows(pol)
    for i in range(9):
        step.add_row(("m", i, 100), torch.ones(25), ("k", i))
    assert len(step.blocks) == 3
