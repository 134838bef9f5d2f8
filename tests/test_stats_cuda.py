"""The fused CUDA statistics (ampdoctor.stats_cuda) give exactly the torch path's rows, and a
watch on CUDA writes the same trace with either. Run on the GPU machine: ``pytest -m cuda``."""

import os

import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor import stats, stats_cuda
from ampdoctor.formats import FORMATS
from ampdoctor.trace import TraceReader

pytestmark = pytest.mark.cuda

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
SIZES = (0, 1, 3, 17, 1000, 1023, 1024, 1025, 16383, 16384, 16385, 100_003, (1 << 20) + 7)


@pytest.fixture(autouse=True, params=["nvrtc", "triton"])
def _fused(request, monkeypatch):
    """Every test runs on both fused paths: the NVRTC-compiled CUDA kernel and the Triton one."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if request.param == "triton":
        pytest.importorskip("triton")
    monkeypatch.delenv(stats_cuda.ENV_DISABLE, raising=False)
    monkeypatch.setenv(stats_cuda.ENV_BACKEND, request.param)
    stats_cuda.uninstall()
    assert stats_cuda.backend() == request.param, (stats_cuda._state, request.param)
    yield request.param
    stats_cuda.uninstall()


def _awkward(dtype, n, g):
    """Random magnitudes over the whole fp32 range and beyond, with NaN, ±Inf, ±0, the format
    limits, subnormals and values just around 65504 planted."""
    if n == 0:
        return torch.empty(0, dtype=dtype, device="cuda")
    x = torch.randn(n, generator=g, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-160, 140, (n,), generator=g).to(torch.float64))
    if dtype != torch.float64:
        x = x.clamp(-3.4e38, 3.4e38)
    x = x.to(dtype)
    fi = torch.finfo(dtype)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, fi.max, -fi.max, fi.tiny,
                            fi.tiny * fi.eps, -fi.tiny * fi.eps, 65504.0, 65520.0, 65536.0, -70000.0, 2.0 ** -24,
                            2.0 ** -25, 2.0 ** -14, 2.0 ** -133, 2.0 ** -149, 448.0, 464.0, 57344.0, 61440.0],
                           dtype=torch.float64).to(dtype)
    k = max(1, n // 7)
    idx = torch.randint(0, n, (k,), generator=g)
    x[idx] = special[torch.randint(0, len(special), (k,), generator=g)]
    return x.cuda()


def _tensors(g):
    ts = [_awkward(dt, n, g) for dt in DTYPES for n in SIZES]
    ts += [
        torch.full((5000,), float("nan"), device="cuda", dtype=torch.float16),
        torch.full((300,), float("-inf"), device="cuda", dtype=torch.bfloat16),
        torch.zeros(4097, device="cuda"),
        torch.randn(64, 48, device="cuda", dtype=torch.float16).t(),            # not contiguous
        torch.randn(1001, device="cuda")[1:],                                     # not 16-byte aligned
        torch.randn(3, 8, 8, 5, device="cuda").to(memory_format=torch.channels_last),
    ]
    for dt in DTYPES:  # no NaN/Inf/subnormal: blocks take the exponent-field fast path
        for scale in (1.0, 1e-3, 3e4, 1e30, 1e-30):
            x = torch.randn(40_000, generator=g, dtype=torch.float64) * scale
            ts += [x.to(dt).cuda(), x.relu().to(dt).cuda()]
    if hasattr(torch, "float8_e4m3fn"):
        ts.append(torch.randn(333, device="cuda").to(torch.float8_e4m3fn))      # falls back to torch
    return ts


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_fused_rows_equal_torch_path(fmt):
    fmt = FORMATS[fmt]
    g = torch.Generator().manual_seed(hash(fmt.name) % 1000)
    ts = _tensors(g)
    ref = torch.stack([stats.tensor_stats(t, fmt) for t in ts])
    got = stats_cuda.fused_batch_stats(ts, fmt)
    assert got.shape == ref.shape and got.dtype == torch.float64 and got.device == ref.device
    bad = (got != ref).any(1).nonzero().flatten().tolist()
    assert not bad, [(ts[i].dtype, ts[i].numel(), (got[i] != ref[i]).nonzero().flatten().tolist()) for i in bad]
    # and the torch path on the GPU agrees with the CPU (the reference the numpy tests check)
    cpu = torch.stack([stats.tensor_stats(t.cpu(), fmt) for t in ts])
    assert torch.equal(ref.cpu(), cpu)


@pytest.mark.parametrize("dtype", DTYPES)
def test_single_tensors_and_backend_seam(dtype):
    fmt = FORMATS["fp16"]
    g = torch.Generator().manual_seed(1)
    assert stats_cuda.install()
    for n in (0, 1, 31, 70_000):
        t = _awkward(dtype, n, g)
        assert torch.equal(stats.batch_stats([t], fmt), stats.tensor_stats(t, fmt)[None])
    assert stats_cuda.fused_batch_stats([torch.ones(3)], fmt) is None  # CPU: not ours


def test_huge_tensor_many_chunks():
    fmt = FORMATS["fp16"]
    x = torch.randn(50_000_000, device="cuda", dtype=torch.float16)  # longer chunks than the minimum
    x[123] = float("inf")
    x[49_999_999] = 1e-7  # fp16 subnormal
    assert torch.equal(stats_cuda.fused_batch_stats([x, x[:1000]], fmt),
                       torch.stack([stats.tensor_stats(x, fmt), stats.tensor_stats(x[:1000], fmt)]))


def test_no_host_sync():
    fmt = FORMATS["bf16"]
    ts = [t for t in _tensors(torch.Generator().manual_seed(2)) if t.dtype in DTYPES]
    stats_cuda.fused_batch_stats(ts, fmt)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        stats_cuda.fused_batch_stats(ts, fmt)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_planned_rows_equal_batch_rows_and_follow_the_tensors(_fused):
    """The weights' kept launch plan: the same rows as a batch, call after call while the values
    change in place; planned again when a tensor moves; not used where it cannot be."""
    fmt = FORMATS["fp16"]
    g = torch.Generator().manual_seed(3)
    dts = (torch.float32, torch.float16, torch.bfloat16)
    ts = [_awkward(dts[i % 3], n, g) for i, n in enumerate([1, 17, 1000, 4096, 100_003] * 30)]  # several tables
    memo: dict = {}
    gate = torch.zeros(1, dtype=torch.int32, device="cuda")

    def check():
        got = stats_cuda.planned_rows(ts, fmt, gate, memo)
        ref = torch.stack([stats.tensor_stats(t, fmt) for t in ts])
        assert got is not None and torch.equal(got, ref)
        assert int(gate) == int(bool((ref[:, 1:4] != 0).any()))

    if _fused != "nvrtc":  # the plan is the NVRTC kernels'
        assert stats_cuda.planned_rows(ts, fmt, gate, memo) is None and not memo
        return
    check()
    plan = memo["plan"]
    for t in ts:  # new values, same tensors: the same plan
        t.mul_(3).add_(1)
    gate.zero_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        check_out = stats_cuda.planned_rows(ts, fmt, gate, memo)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert memo["plan"] is plan and torch.equal(check_out, torch.stack([stats.tensor_stats(t, fmt) for t in ts]))
    ts[7] = ts[7].clone()  # moved (another address): planned again
    check()
    assert memo["plan"] is not plan
    ts[0] = torch.randn(64, 48, device="cuda").t()  # not contiguous: the batch path
    assert stats_cuda.planned_rows(ts, fmt, gate, memo) is None and not memo


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(32, 64)
        self.act = nn.ReLU(inplace=True)
        self.lin2 = nn.Linear(64, 64)
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 1)

    def forward(self, x):
        h = self.lin2(self.act(self.lin1(x)))
        h += 0.5  # in place on a recorded activation
        return self.head(self.norm(h))


def _watched_run(tmp_path, name, fused: bool, steps=6):
    if fused:
        os.environ.pop(stats_cuda.ENV_DISABLE, None)
    else:
        os.environ[stats_cuda.ENV_DISABLE] = "0"
        stats_cuda.uninstall()
    try:
        torch.manual_seed(0)
        model = _Net().cuda()
        with torch.no_grad():
            model.lin2.weight.mul_(40000.0)  # overflows fp16 after a few steps of growing inputs
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        scaler = torch.amp.GradScaler("cuda")
        g = torch.Generator(device="cuda").manual_seed(0)
        with ampdoctor.watch(model, trace=str(tmp_path / f"{name}.sqlite")):
            for i in range(steps):
                x = torch.randn(16, 32, device="cuda", generator=g) * (1 + 40 * i)
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = model(x).float().pow(2).mean()
                opt.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            installed = stats._backend is stats_cuda.fused_batch_stats
    finally:
        os.environ.pop(stats_cuda.ENV_DISABLE, None)
    assert installed == fused
    r = TraceReader(tmp_path / f"{name}.sqlite")
    key = lambda s: (s["step"], s["layer"], s["kind"], s["slot"], s["call"])  # noqa: E731
    events = [(e["step"], e["kind"], e["layer"], e["detail"]) for e in r.events()]
    steps_ = [(s["step"], repr(s["loss"]), s["scale"], s["skipped"]) for s in r.steps()]  # repr: nan == nan
    return sorted(r.stats(), key=key), events, steps_


def test_watch_on_cuda_same_trace_as_torch_path(tmp_path):
    ref = _watched_run(tmp_path, "torch", fused=False)
    got = _watched_run(tmp_path, "fused", fused=True)
    assert len(got[0]) == len(ref[0]) > 0
    for a, b in zip(got[0], ref[0]):
        assert a == b
    assert got[1] == ref[1]
    assert got[2] == ref[2]
    assert any(e[1] == "first_nonfinite" for e in got[1])


def test_recorded_steps_do_not_sync_in_hooks(tmp_path):
    """Fused AdamW keeps GradScaler sync-free: the only syncs left would be ampdoctor's."""
    torch.manual_seed(0)
    model = _Net().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cuda")
    x = torch.randn(16, 32, device="cuda")
    with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite")):
        for i in range(4):
            if i == 2:
                torch.cuda.set_sync_debug_mode("error")
            try:
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = model(x).float().pow(2).mean()
                opt.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            finally:
                torch.cuda.set_sync_debug_mode(0)
    r = TraceReader(tmp_path / "t.sqlite")
    assert [s["step"] for s in r.steps()] == [0, 1, 2, 3]


def test_gate_and_nonfinite_flags(_fused):
    """Stage 2 sets the gate exactly when a row counts NaN/Inf; the flags kernel reads nothing
    while the gate is 0 and gives the torch path's NaN/Inf flag once it is set."""
    fmt = FORMATS["fp16"]
    g = torch.Generator().manual_seed(3)
    ts = _tensors(g)
    clean = [t for t in ts if t.numel() and bool(torch.isfinite(t.float()).all())]
    gate = torch.zeros(1, dtype=torch.int32, device="cuda")
    stats.batch_stats(clean, fmt, gate)
    assert int(gate) == 0
    ref = torch.stack([(~torch.isfinite(t.float())).any() for t in ts]).double()
    assert 0 < ref.sum() < len(ts)
    stats.batch_stats(ts, fmt, gate)
    assert int(gate) == 1
    if _fused != "nvrtc":
        return
    shut = torch.zeros(1, dtype=torch.int32, device="cuda")
    ours = torch.tensor([t.dtype in (torch.float16, torch.bfloat16, torch.float32) for t in ts], device="cuda")
    # fp64/fp8 are checked with torch ops whatever the gate; the kernel's dtypes not at all
    assert torch.equal(stats_cuda.fused_nonfinite(ts, shut), torch.where(ours, 0.0, ref))
    assert torch.equal(stats_cuda.fused_nonfinite(ts, gate), ref)
    big = torch.randn(30_000_000, device="cuda", dtype=torch.float16)  # many chunks, more than the grid
    for i in (0, 65535, 65536, 29_999_999):
        big[i] = float("nan")
        assert stats_cuda.fused_nonfinite([big, big[:i], big[i:]], gate).tolist() == [1.0, 0.0, 1.0]
        big[i] = 0.0
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        stats_cuda.fused_nonfinite(ts[:40], gate)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_gated_flags_on_cuda_attribute_as_full_rows(tmp_path, monkeypatch, _fused):
    """A residual sum that overflows (pure half): the flag-only tensor's gated check on the GPU
    names the block, as full rows for every tensor do."""
    from ampdoctor import rows as rows_mod

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.norm = nn.Linear(16, 16), nn.LayerNorm(16)

        def forward(self, x):
            return self.norm(x + self.lin(x))

    got = {}
    for gated in (False, True):
        monkeypatch.setattr(rows_mod, "GATED_FLAGS", gated)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), Block(), nn.Linear(16, 1)).cuda().half()
        with torch.no_grad():
            model[1].lin.weight.copy_(torch.eye(16))
            model[1].lin.bias.zero_()
            model[0].weight.fill_(0.25)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        path = tmp_path / f"g{int(gated)}.sqlite"
        with ampdoctor.watch(model, trace=str(path)) as w:
            for i in range(5):  # the residual sum: 8000 * 2**i, inf at step 4
                x = torch.full((2, 8), 2000.0 * 2 ** i, device="cuda").half()
                (model(x).float().mean() * 1e-3).backward()
                opt.step()
                opt.zero_grad()
            uses_gate = w.session._rows.policy.gated(torch.device("cuda", torch.cuda.current_device()))
        assert uses_gate == (gated and _fused == "nvrtc")
        r = TraceReader(path)
        got[gated] = [(e["kind"], e["step"], e["layer"], sorted(e["detail"].items())) for e in r.events()
                      if e["kind"] in ("first_nonfinite", "grad_nonfinite")]
    assert got[True] == got[False]
    assert any(k == "first_nonfinite" and layer == "1" and step >= 1 for k, step, layer, _ in got[True]), got


def _edited_run(tmp_path, name, defer, monkeypatch, edit_at=None, steps=6):
    from ampdoctor import session as session_mod
    monkeypatch.setattr(session_mod, "DEFER_HOST_READ", defer)
    torch.manual_seed(0)
    model = _Net().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    with ampdoctor.watch(model, trace=str(tmp_path / f"{name}.sqlite")):
        for i in range(steps):
            x = torch.randn(16, 32, device="cuda", generator=g)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            if i == edit_at:
                with torch.no_grad():
                    model.lin2.weight.mul_(0.5)
    r = TraceReader(tmp_path / f"{name}.sqlite")
    key = lambda s: (s["step"], s["layer"], s["kind"], s["slot"], s["call"])  # noqa: E731
    notes = [e["detail"]["message"] for e in r.events("note")]
    return sorted(r.stats(), key=key), notes, [(s["step"], s["loss"], s["scale"]) for s in r.steps()]


def test_weights_read_at_the_next_backward_on_cuda(tmp_path, monkeypatch, _fused):
    """On CUDA a recorded step's weights are measured, and its host copy started, where the next backward
    starts: the trace equals the one read at each boundary (AMPDOCTOR_DEFER_READ=0). A script that
    changes its weights between update() and the next backward gets a note, that step's rows show the
    change, and every later step is read at its boundary again."""
    ref, ref_notes, ref_steps = _edited_run(tmp_path, "now", False, monkeypatch)
    got, notes, got_steps = _edited_run(tmp_path, "later", True, monkeypatch)
    assert got == ref and len(ref) > 0 and got_steps == ref_steps and notes == ref_notes == []
    ref, _, _ = _edited_run(tmp_path, "now_edit", False, monkeypatch, edit_at=2)
    got, notes, _ = _edited_run(tmp_path, "later_edit", True, monkeypatch, edit_at=2)
    differ = [(a["step"], a["kind"], a["slot"]) for a, b in zip(ref, got) if a != b]
    assert differ == [(2, "weight", "weight")], differ
    assert len(notes) == 1 and "end of step 2" in notes[0]
