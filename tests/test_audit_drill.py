"""Audit findings on the drill-down and the culprit's advice: an HF-style float attention mask is not the
overflow (the q.k^T matmul is), an fp32 weight beyond fp16's max is named as the cause of a NaN, and a
bisect op entry says when its abs-max is of the op recomputed in FP32."""

from __future__ import annotations

import inspect
import json
import math
import os

import numpy as np
import pytest
import torch
from torch import nn

from ampdoctor.bisect.drill import OpProbe

FP16_MAX = 65504.0
FP16_OVERFLOW = 65520.0  # round-to-nearest: fp16 values at or above this round to Inf


class GPT2Attention(nn.Module):
    """HF GPT-2's eager attention: scores scaled after the product, then an additive float mask."""

    def __init__(self, d: int = 16, heads: int = 2):
        super().__init__()
        self.d, self.heads = d, heads
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x, attention_mask):
        b, t, _ = x.shape
        q, k, v = self.c_attn(x).split(self.d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        attn_weights = q @ k.transpose(-1, -2) * (1.0 / math.sqrt(q.shape[-1]))
        attn_weights = attn_weights + attention_mask
        attn_weights = torch.softmax(attn_weights.float(), dim=-1)
        out = (attn_weights.to(v.dtype) @ v).transpose(1, 2).reshape(b, t, self.d)
        return self.c_proj(out)


class Block(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = GPT2Attention(d)

    def forward(self, x, mask):
        return x + self.attn(self.ln(x), mask)


class TinyGPT(nn.Module):
    def __init__(self, d: int = 16, mask_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.mask_dtype = mask_dtype
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(2)])
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        t = x.shape[1]
        causal = torch.tril(torch.ones(t, t, dtype=self.mask_dtype))
        mask = ((1.0 - causal) * torch.finfo(self.mask_dtype).min)[None, None]  # as HF transformers builds it
        h = self.inp(x)
        for blk in self.blocks:
            h = blk(h, mask)
        return self.head(h)


def line_of(obj, text: str) -> int:
    src, start = inspect.getsourcelines(obj)
    return start + next(i for i, line in enumerate(src) if text in line)


QK_LINE = f"{os.path.basename(__file__)}:{line_of(GPT2Attention.forward, 'q @ k')}"


def _blow_up_qk(model: TinyGPT, factor: float) -> None:
    with torch.no_grad():
        model.blocks[1].attn.c_attn.weight[:32] *= factor  # the q and k projections' rows


def _capture_qk(attn: GPT2Attention, store: list) -> object:
    def hook(module, args, out):
        q, k, _ = out.detach().split(attn.d, dim=-1)
        b, t, _ = q.shape
        store.append([z.reshape(b, t, attn.heads, -1).transpose(1, 2).double().numpy() for z in (q, k)])
    return attn.c_attn.register_forward_hook(hook)


def _train(model: nn.Module, steps: int, break_at: int | None, probe: OpProbe | None = None,
           factor: float = 400.0) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        if probe is not None:
            probe.step = step
        if step == break_at:
            _blow_up_qk(model, factor)
        x = torch.randn(4, 6, 8, generator=gen)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def test_the_drill_names_the_qk_matmul_not_the_add_of_an_hf_float_mask():
    """The add of HF's finfo(float32).min mask holds values beyond fp16's max at every step (the mask's, in
    float32): it was the drill-down's first op, at step 0, before anything overflowed. The q.k^T matmul,
    whose fp16 output is Inf from finite inputs at the step the weights blow up, is the one to name."""
    torch.manual_seed(0)
    model = TinyGPT()
    qk: list = []
    handle = _capture_qk(model.blocks[1].attn, qk)
    with OpProbe(model, ["blocks.1.attn"]) as probe:
        _train(model, 4, break_at=2, probe=probe)
    handle.remove()
    first = probe.first
    assert first is not None and (first.op, first.where, first.step, first.phase) == ("matmul", QK_LINE, 2, "forward"), \
        probe.findings[:3]
    assert first.nonfinite and not first.passthrough and first.dtype == "float16"
    # its counts and magnitude against numpy: q.k^T of the fp16 q and k it was given at step 2
    q, k = qk[2]
    ref = q @ np.swapaxes(k, -1, -2)
    assert not (np.abs(np.abs(ref) - FP16_OVERFLOW) < 1.0).any()  # no value on the rounding edge
    assert first.overflow_count == int((np.abs(ref) >= FP16_OVERFLOW).sum()) > 0
    assert first.absmax_fp32 == pytest.approx(float(np.abs(ref).max()), rel=1e-5)
    # steps 0 and 1 (nothing too large) gave no finding, and the mask add is never blamed
    assert all(f.step >= 2 for f in probe.findings), [(f.op, f.step) for f in probe.findings]
    assert not any(f.op == "add" and f.phase == "forward" and not f.passthrough for f in probe.findings)


@pytest.mark.parametrize("half", [False, True], ids=["autocast-fp32-mask", "half-model-fp16-mask"])
def test_an_op_that_only_adds_a_mask_is_not_blamed(half):
    """No real overflow: the only values beyond fp16's max are the mask's (float32's finfo.min under
    autocast), or, in a .half() model, -Inf where fp16's finfo.min mask plus a negative score rounds
    beyond -65504. Neither is an overflow of the add, and no op may be named."""
    torch.manual_seed(0)
    model = TinyGPT(mask_dtype=torch.float16 if half else torch.float32)
    _blow_up_qk(model, 30.0)  # scores of a few hundred: large, far from fp16's max
    x = torch.randn(4, 6, 8)
    if half:
        model = model.half()
        x = x.half()
    qk: list = []
    handle = _capture_qk(model.blocks[1].attn, qk)
    with OpProbe(model, ["blocks.1.attn"], backward=False) as probe:
        with torch.autocast("cpu", dtype=torch.float16, enabled=not half):
            model(x)
    handle.remove()
    # what the add really held: numpy's scores plus the mask
    q, k = qk[0]
    scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    assert np.abs(scores).max() < FP16_MAX / 8
    masked = np.triu(np.ones((6, 6), bool), 1)
    if half:  # (1.0 - causal) * finfo.min in fp16, plus the fp16 scores: -Inf below -65520
        assert ((scores - FP16_MAX < -FP16_OVERFLOW) & masked).any()
    assert probe.findings == [], [(f.op, f.where, f.overflow_count, f.nonfinite) for f in probe.findings]
    assert probe.first is None
    assert probe.worst is not None and probe.worst.op == "matmul"  # (the largest op of its own making)


class ScoresAttention(nn.Module):
    """Scores from a fixed projection (so the test knows them) plus an HF float32 mask."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.q = nn.Linear(d, d, bias=False)

    def forward(self, x, mask):
        q = self.q(x)
        scores = q @ q.transpose(-1, -2)
        scores = scores + mask
        return torch.softmax(scores, -1)


def test_an_overflow_inside_a_masked_tensor_is_counted_without_the_mask():
    """An fp32 run measured against fp16: the add passes the scores on (some beyond 65504) and the mask's
    finfo.min. Its overflow count was both; only the scores' count, and the add passes them on."""
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("attn", ScoresAttention())
    with torch.no_grad():
        model.attn.q.weight.copy_(torch.randn(8, 8) * 60)
    x = torch.randn(2, 5, 8)
    mask = (1.0 - torch.tril(torch.ones(5, 5))) * torch.finfo(torch.float32).min
    with OpProbe(model, ["attn"], backward=False) as probe:
        model.attn(x, mask)
    qn = x.double().numpy() @ model.attn.q.weight.detach().double().numpy().T
    scores = qn @ np.swapaxes(qn, -1, -2)
    assert not (np.abs(np.abs(scores) - FP16_MAX) < 1.0).any()
    unmasked = ~np.triu(np.ones((5, 5), bool), 1)
    made = int(((np.abs(scores) > FP16_MAX) & unmasked).sum())
    assert 0 < made < int((np.abs(scores) > FP16_MAX).sum()) < scores.size  # some too large are masked
    ops = {f.op: f for f in probe.findings}
    assert probe.first.op == "matmul" and probe.first.overflow_count == int((np.abs(scores) > FP16_MAX).sum())
    assert ops["add"].overflow_count == made and ops["add"].passthrough


def _train_gpt(steps: int) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    _train(TinyGPT(), steps, break_at=3)


def test_bisect_op_entry_names_the_matmul_and_says_its_absmax_is_recomputed_in_fp32(tmp_path):
    """End to end: bisect's first op is the q.k^T matmul (not the mask add), and its entry, whose abs-max is
    above fp16's max while its dtype is float16, says the abs-max is of the op recomputed in FP32."""
    import ampdoctor

    res = ampdoctor.bisect(lambda: _train_gpt(8), out=tmp_path)
    assert res["verdict"] == "culprit" and res["culprits"] == ["blocks.1.attn"], res
    first = res["ops"][0]
    assert (first["pick"], first["op"], first["where"], first["dtype"]) == ("first", "matmul", QK_LINE, "float16")
    assert first["absmax"] > FP16_MAX and first["absmax_of"] == "fp32_recompute", first
    assert all(o["absmax_of"] == "output" for o in res["ops"][1:]), res["ops"]
    assert not any(o["op"] == "add" for o in res["ops"]), res["ops"]
    said = f"matmul at {QK_LINE} overflows (abs-max {first['absmax']:.3g} when recomputed in FP32; its float16 " \
           "output held Inf/NaN)"
    assert any(a.startswith(said) for a in res["advice"]), res["advice"]
    # the line scales the product after making it: the advice says so, quoting the line
    assert first["source"] == "attn_weights = q @ k.transpose(-1, -2) * (1.0 / math.sqrt(q.shape[-1]))", first
    assert any(a.startswith(said + ": that line scales the product after making it (`attn_weights = q @ k")
               for a in res["advice"]), res["advice"]
    assert json.loads((tmp_path / "bisect.json").read_text())["ops"][0]["absmax_of"] == "fp32_recompute"
    from ampdoctor.report import build_report

    text = "\n".join(build_report(tmp_path).advice)
    assert (f"The first overflowing op is matmul at {QK_LINE} in blocks.1.attn (abs-max {first['absmax']:.3g} when "
            "recomputed in FP32 vs fp16 max 65504; its float16 output held Inf/NaN)") in text, text
    # as bisect's own advice: a product already Inf/NaN is not saved by a clamp after it (it offered one)
    assert "clamping the scores after the product is too late: it is Inf/NaN already" in text and \
        "scores.clamp(" not in text, text
    from ampdoctor.bisect.cli import _summary
    from ampdoctor.report.html import render_html

    line = f"first op in blocks.1.attn: matmul at {QK_LINE} (forward, abs-max {first['absmax']:.3g} when recomputed in FP32)"
    assert line in _summary(res), _summary(res)
    assert "(recomputed in FP32)</td>" in render_html(build_report(tmp_path))


def test_attention_advice_without_the_field_is_unchanged():
    """An op entry without ``absmax_of`` (an older bisect.json) reads as before."""
    from ampdoctor.bisect.driver import fix_snippets

    ops = [{"layer": "a", "op": "matmul", "where": "m.py:3", "absmax": 1.2e5, "phase": "forward", "pick": "first"}]
    assert "matmul at m.py:3 overflows (abs-max 1.2e+05): scale" in fix_snippets(["a"], {"a": "Attn"}, ops)[2]
    ops[0].update(absmax_of="output", dtype="float32")
    assert "matmul at m.py:3 overflows (abs-max 1.2e+05): scale" in fix_snippets(["a"], {"a": "Attn"}, ops)[2]


class Sqrt(nn.Module):
    def forward(self, x):
        return torch.sqrt(x)  # NaN where x < 0: an invalid operation, no weight involved


def _run_watched(model: nn.Module, trace: str, steps: int = 3) -> None:
    import ampdoctor

    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    gen = torch.Generator().manual_seed(1)
    with ampdoctor.watch(model, trace=trace):
        for _ in range(steps):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 8, generator=gen)).float().pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


def test_a_nan_from_an_fp32_weight_beyond_fp16_max_names_the_weight(tmp_path):
    """An fp32 weight holding +-1e5 becomes +-Inf when autocast casts it to fp16, and Inf - Inf in the
    matmul is NaN: the layer's output had NaN and no Inf, its finite values small, and the advice said
    it "produced NaN without any Inf or overflow" (an invalid operation?). Name the weight instead."""
    from ampdoctor.report import build_report
    from ampdoctor.report.culprit import culprit_advice

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.Linear(8, 1))
    with torch.no_grad():
        model[2].weight[0, :8] = 1e5
        model[2].weight[0, 8:] = -1e5
    over = int((model[2].weight.detach().abs().numpy() > FP16_MAX).sum())
    trace = tmp_path / "t.sqlite"
    _run_watched(model, str(trace))
    rep = build_report(trace)
    assert rep.diagnosis.first_nonfinite["layer"] == "2"
    act = next(r for r in rep.layers if r.layer == "2" and r.kind == "activation")
    assert act.nan and not act.inf and not act.overflow  # the case the old advice misread
    text = "\n".join(culprit_advice(rep))
    assert f"2.weight (float32) holds {over} values above the fp16 max 65504 (abs-max 1.00e+05, from step 0): " \
           "autocast casts the weights to fp16 when 2 runs, and those values become Inf" in text, text
    assert "produced NaN without any Inf or overflow" not in text and "2.bias" not in text, text
    assert over == 16
    # the report rendered without its trace: the layer's numbers, without the parameter's name
    trace.unlink()
    text = "\n".join(culprit_advice(rep))
    assert "The float32 weights of 2 hold values above the fp16 max 65504 (abs-max 1.00e+05, from step 0): " in text, text


def test_a_nan_of_an_invalid_operation_still_says_so(tmp_path):
    """The other side: a NaN made by sqrt of a negative number, every weight in range, keeps the
    invalid-operation advice and names no weight."""
    from ampdoctor.report import build_report
    from ampdoctor.report.culprit import culprit_advice

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Sqrt(), nn.Linear(8, 1))
    _run_watched(model, str(tmp_path / "t.sqlite"))
    rep = build_report(tmp_path / "t.sqlite")
    text = "\n".join(culprit_advice(rep))
    assert "1 produced NaN without any Inf or overflow" in text and "above the fp16 max" not in text, text


def test_a_product_scaled_after_it_is_made_is_told_apart():
    from ampdoctor.bisect.driver import _scaled_after

    assert _scaled_after("w = q @ k.transpose(-1, -2) * (1.0 / math.sqrt(d))")
    assert _scaled_after("w = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d)")
    assert _scaled_after("w = (q @ k.T) * s")
    assert not _scaled_after("w = (q * s) @ k.T")
    assert not _scaled_after("w = q @ k.view(-1, 2)")
    assert not _scaled_after("x = torch.bmm(a, b)  # / 2")
    assert not _scaled_after("x = y * 2")


def test_the_weights_advice_keeps_a_modules_name_as_it_is(tmp_path):
    # it began the sentence with the name capitalised: "Proj.weight (float32) holds ..."
    from ampdoctor.report import build_report
    from ampdoctor.report.culprit import culprit_advice

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.proj, self.out = nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(8, 1)

        def forward(self, x):
            return self.out(self.proj(torch.relu(self.inp(x))))

    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.proj.weight[0, :8] = 1e5
        model.proj.weight[0, 8:] = -1e5
    _run_watched(model, str(tmp_path / "t.sqlite"))
    text = "\n".join(culprit_advice(build_report(tmp_path / "t.sqlite")))
    assert "proj.weight (float32) holds 16 values above the fp16 max" in text and "Proj.weight" not in text, text


class _Square(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * x * self.alpha  # the output itself above the fp16 max


class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc, self.gate, self.out = nn.Linear(d, d), _Square(d), nn.Linear(d, 1)

    def forward(self, x):
        return self.out(self.gate(self.fc(x)))


def test_a_pure_half_suspect_whose_output_overflows_is_told_the_cast_back_overflows_too(tmp_path):
    # keep_fp32(gate) alone casts its output back to fp16, where it overflows again: the run's advice
    # named the gate alone (applied, the loss stayed NaN); bisect's answer is the block around it
    import ampdoctor
    from ampdoctor.report import build_report
    from ampdoctor.report.culprit import culprit_advice

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), _Block(8)).half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    with ampdoctor.watch(model, trace=tmp_path / "t.sqlite"):
        for _ in range(2):
            loss = model(torch.full((2, 4), 2000.0, dtype=torch.float16)).float().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    rep = build_report(tmp_path / "t.sqlite")
    assert rep.diagnosis.first_nonfinite["layer"] == "1.gate", rep.diagnosis.first_nonfinite
    text = "\n".join(culprit_advice(rep))
    assert "keep_fp32(1.gate) casts its output back to float16" in text, text
    assert "Then keep its parent instead: `ampdoctor.keep_fp32(model[1])`" in text, text


def test_a_diverging_run_is_told_its_overflow_may_be_the_divergence(tmp_path):
    # a learning rate of 0.5: the loss grew 20-fold, then layer 2's output overflowed; the advice named
    # layer 2 alone, and bisect's all-FP32 control broke too (not_precision)
    import ampdoctor
    from ampdoctor.report import build_report
    from ampdoctor.report.culprit import culprit_advice

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    sc = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(1)
    with ampdoctor.watch(m, trace=tmp_path / "t.sqlite"):
        for _ in range(16):
            x = torch.randn(16, 8, generator=g) * 3
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(m(x).float(), x.sum(1, keepdim=True))
            opt.zero_grad()
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
    rep = build_report(tmp_path / "t.sqlite")
    assert rep.diagnosis.first_nonfinite is not None
    text = "\n".join(culprit_advice(rep))
    assert "Before that, the loss grew from " in text and "a training that diverges" in text, text
    assert "verdict is not_precision" in text
    # the whole advice says how the loss grew once (the divergence advice and the culprit's both said it)
    grew = [a for a in rep.advice if a.startswith(("The loss grew from", "Before that, the loss grew from"))]
    assert len(grew) == 1, rep.advice


def test_a_learning_rate_divergence_says_how_the_loss_grew_once(tmp_path):
    # tests/scripts/lr_diverges.py: the divergence advice ("The loss grew from 0.0909 (step 4) to ...") and the
    # first overflowing layer's ("Before that, the loss grew from 0.0909 (step 4) to ...") said the same twice
    import subprocess
    import sys
    from pathlib import Path

    from ampdoctor.report import build_report

    script = Path(__file__).parent / "scripts" / "lr_diverges.py"
    subprocess.run([sys.executable, "-m", "ampdoctor", "run", "--out", str(tmp_path / "run"), str(script), "--", "--steps", "60"],
                   capture_output=True, text=True, timeout=300, check=False)
    rep = build_report(tmp_path / "run")
    grew = [a for a in rep.advice if "the loss grew from" in a.lower()]
    assert len(grew) == 1 and grew[0].startswith("The loss grew from") and "optimisation divergence" in grew[0], rep.advice
    assert any("Keep" in a and "in FP32" in a for a in rep.advice), rep.advice  # (the layer is still named)
