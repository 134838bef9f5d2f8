"""Advice: the loss-scale advisor against closed forms and applied to a real fixture, GradScaler
health, the culprit's fix, readiness phrasing."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from report_helpers import fp32_trace, overflow_trace, synthetic_trace

from ampdoctor.naming import root_hint
from ampdoctor.report import build_report
from ampdoctor.report.advice import (
    loss_scale_analysis,
    loss_scale_range,
    module_expr,
    readiness,
    scaler_health,
)

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "fixtures"


def _env() -> dict:
    env = dict(os.environ)
    env.pop("AMPDOCTOR_CONFIG", None)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _final_loss(out: str) -> float:
    m = re.search(r"final loss (\S+)", out)
    assert m, out[-2000:]
    return float(m.group(1))


def _fixture_constants(name: str) -> dict:
    text = (FIXTURES / name).read_text()
    return {k: float(v) for k, v in re.findall(r"^([A-Z_]+) = ([0-9.e+-]+)", text, flags=re.M)}


# -- closed forms on synthetic traces -------------------------------------------------------------------
def test_loss_scale_range_closed_form(tmp_path):
    # 1000 gradient values in binade -10 as recorded at scale 2**10, abs-max 1.5 * 2**-10: unscaled binade
    # -20, abs-max 1.5 * 2**-20. no overflow: 1.5 * 2**(k - 20) <= 65504 -> k <= 35 (the largest value, not
    # its binade's top, which said k <= 34: one scale too few); normal: -20 + k >= -14 -> k >= 6.
    p = synthetic_trace(tmp_path / "t.sqlite", grad_exps=[(-10, 1000)], scales=[2.0 ** 10] * 4)
    rep = build_report(p)
    a = loss_scale_analysis(rep)
    assert (a.k_lo, a.k_hi, a.top_exp) == (6, 35, -20)
    assert 1.5 * 2.0 ** (35 - 20) <= 65504 < 1.5 * 2.0 ** (36 - 20)
    assert a.steps_used == 4 and a.values == 4000
    lo, hi, rec = loss_scale_range(rep)
    assert (lo, hi) == (2.0 ** 6, 2.0 ** 35)
    assert lo <= rec <= hi and rec == 2.0 ** 21


def test_an_accumulating_steps_fp32_grad_sums_do_not_set_the_loss_scale(tmp_path):
    # 4 micro-batches a step: the fp32 .grad is read after each backward. Only the first reading is one
    # micro-batch's gradient (fp16, upcast); the later ones are sums never cast to fp16, and they said
    # the scale could go 2 binades less high than it can (and were counted 4 times over)
    import numpy as np

    from ampdoctor.formats import get_format
    from ampdoctor.trace import TraceWriter, hist_blob

    f = get_format("fp16")
    w = TraceWriter(tmp_path / "t.sqlite")
    w.set_meta(format="fp16", every=1, status="finished", argv=["synthetic"])
    w.add_layers([(0, "lin", "Linear", 0, 1, None)])
    rows = []
    for step in range(3):
        for mb in range(4):
            amax = 1.5 * 2.0 ** (-6 + mb)  # (as recorded at scale 2**10) the sum grows with each micro-batch
            hist = np.zeros(f.n_bins, dtype=np.int64)
            hist[1 + (-6 + mb) - f.min_exp] = 100
            rows.append((step, 0, "weight_grad", "weight", 0, "float32", 100, 400, 0, 0, 0, 0, -amax, amax, amax, amax,
                         0, 0, 0, hist_blob(hist)))
        w.add_step((step, 1.0, 2.0 ** 10, 0, step + 1, 1, 0.0))
    w.add_stats(rows)
    w.commit()
    w.close()
    a = loss_scale_analysis(build_report(tmp_path / "t.sqlite"))
    # the first readings: 1.5 * 2**-16 unscaled; 1.5 * 2**(k - 16) <= 65504 -> k <= 31
    assert a.values == 300 and a.top_exp == -16 and a.k_hi == 31


def test_loss_scale_range_allows_one_percent_underflow(tmp_path):
    # 5 of 1000 values two binades lower than the rest: under the 1% allowance, so they do not set lo.
    p = synthetic_trace(tmp_path / "t.sqlite", grad_exps=[(-22, 5), (-20, 995)], scales=[None] * 3)
    a = loss_scale_analysis(build_report(p))
    assert a.k_lo == 6
    p2 = synthetic_trace(tmp_path / "t2.sqlite", grad_exps=[(-22, 20), (-20, 980)], scales=[None] * 3)
    assert loss_scale_analysis(build_report(p2)).k_lo == 8


def test_loss_scale_infeasible_flags_wide_layers(tmp_path):
    p = synthetic_trace(tmp_path / "t.sqlite", grad_exps=[(-24, 500), (10, 500)], scales=[None] * 2)
    rep = build_report(p)
    a = loss_scale_analysis(rep)
    assert not a.feasible and a.too_wide == ["lin"] and a.spans["lin"] == 35
    assert loss_scale_range(rep) is None
    text = "\n".join(rep.advice)
    assert "No single static loss scale" in text and "lin (35 binades)" in text


def test_unscaling_uses_the_scale_of_the_step_before(tmp_path):
    # scale after update: 2**16 at step 0, 2**15 at step 1 (skipped), 2**15 after.
    # step 1's backward ran with 2**16, step 2's with 2**15. Skipped steps are left out.
    p = synthetic_trace(tmp_path / "t.sqlite", grad_exps=[(-4, 100)], scales=[2.0 ** 16, 2.0 ** 15, 2.0 ** 15],
                        skipped=[0, 1, 0])
    a = loss_scale_analysis(build_report(p))
    assert a.steps_used == 2
    # step 0: -4 - 16 = -20; step 2: -4 - 15 = -19 -> top -19, abs-max 1.5 * 2**-19: 1.5 * 2**(k - 19) <= 65504
    assert a.top_exp == -19 and a.k_hi == 34


@pytest.mark.parametrize("scales,skipped,state", [
    ([2.0 ** 16] * 30, [0] * 30, "healthy"),
    ([2.0 ** 15, 2.0 ** 14, 2.0 ** 13] + [2.0 ** 13] * 27, [1, 1, 1] + [0] * 27, "startup"),
    ([2.0 ** (16 - i) for i in range(30)], [1] * 30, "collapse"),
    ([2.0 ** 16] * 10 + [2.0 ** 15] * 20, [0] * 10 + [0 if i % 3 == 2 else 1 for i in range(20)], "persistent"),
    ([2.0 ** (16 + i) for i in range(30)], [0] * 30, "huge"),
    # GradScaler(init_scale=2**40): 22 start-up backoffs down to 2**18, then steps; it never grew, so it
    # is not "grew to 2**39" (an HF audit's BERT run)
    ([2.0 ** (39 - i) for i in range(22)] + [2.0 ** 18] * 18, [1] * 22 + [0] * 18, "startup"),
])
def test_scaler_health(tmp_path, scales, skipped, state):
    p = synthetic_trace(tmp_path / "t.sqlite", grad_exps=[(-4, 10)], scales=scales, skipped=skipped)
    rep = build_report(p)
    h = scaler_health(rep)
    assert h.state == state
    assert h.skipped == sum(skipped)
    assert any("GradScaler" in a for a in rep.advice)


def test_skips_of_a_nan_loss_are_not_start_up_backoffs(tmp_path):
    """An HF Trainer run whose forward overflowed at every step (the loss NaN, every step skipped, the
    scale halved 12 times) was told "12 start-up backoffs are normal; a lower init_scale avoids them"."""
    scales = [2.0 ** (15 - i) for i in range(12)]
    p = synthetic_trace(tmp_path / "nan.sqlite", grad_exps=[(-4, 10)], scales=scales, skipped=[1] * 12,
                        losses=[float("nan")] * 12)
    rep = build_report(p)
    h = scaler_health(rep)
    assert (h.state, h.startup_backoffs, h.nonfinite_loss_skips) == ("persistent", 0, 12)
    text = "\n".join(rep.advice)
    assert "start-up backoffs" not in text and "The loss itself was NaN/Inf in 12 of the skipped steps" in text, text
    # the same skips with a finite loss are start-up backoffs, as before
    p = synthetic_trace(tmp_path / "ok.sqlite", grad_exps=[(-4, 10)], scales=scales[:3] + [2.0 ** 13] * 9,
                        skipped=[1, 1, 1] + [0] * 9)
    h = scaler_health(build_report(p))
    assert (h.state, h.startup_backoffs, h.nonfinite_loss_skips) == ("startup", 3, 0)


def test_a_run_that_skipped_every_step_is_not_told_its_backoffs_are_normal(tmp_path):
    """8 steps, every one skipped with a finite loss (GPT-2's fp16 NewGELU, whose backward makes NaN at
    any scale): the report said "did not break" and "8 start-up backoffs ... are normal"."""
    scales = [2.0 ** (15 - i) for i in range(8)]
    # NaN in the gradients and no Inf: not the scale's overflow -> broken, at the first skipped step
    p = synthetic_trace(tmp_path / "nan.sqlite", grad_exps=[(-4, 10)], scales=scales, skipped=[1] * 8, grad_nan=5)
    rep = build_report(p)
    assert (rep.diagnosis.broke, rep.diagnosis.step, rep.diagnosis.reason) == (True, 0, "skipped_steps")
    assert "their gradients held NaN without any Inf" in rep.diagnosis.lines[0]
    h = scaler_health(rep)
    assert (h.state, h.skipped) == ("nan", 8)
    text = "\n".join(rep.advice)
    assert "These are not start-up backoffs" in text and "are normal" not in text, text
    # an Inf as well: maybe the scale's; not judged, and not called normal either
    p = synthetic_trace(tmp_path / "inf.sqlite", grad_exps=[(-4, 10)], scales=scales, skipped=[1] * 8, grad_nan=5,
                        grad_inf=1)
    rep = build_report(p)
    assert not rep.diagnosis.broke and "took no optimizer step" in rep.diagnosis.lines[0], rep.diagnosis.lines
    assert scaler_health(rep).state == "unsettled"
    text = "\n".join(rep.advice)
    assert "Run more steps" in text and "are normal" not in text, text
    # fewer skipped steps than the oracle's NAN_SKIPS: not judged either
    p = synthetic_trace(tmp_path / "few.sqlite", grad_exps=[(-4, 10)], scales=scales[:3], skipped=[1] * 3, grad_nan=5)
    rep = build_report(p)
    assert not rep.diagnosis.broke and scaler_health(rep).state == "unsettled"
    # backoffs that ended: start-up, as before, NaN or not
    p = synthetic_trace(tmp_path / "ok.sqlite", grad_exps=[(-4, 10)], scales=scales[:5] + [2.0 ** 11] * 5,
                        skipped=[1] * 5 + [0] * 5, grad_nan=5)
    rep = build_report(p)
    assert not rep.diagnosis.broke and scaler_health(rep).state == "startup"
    assert "5 start-up backoffs" in "\n".join(rep.advice)


def test_another_ranks_line_judges_nan_only_skips_as_its_own_report_would(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    scales = [2.0 ** (15 - i) for i in range(8)]
    synthetic_trace(run / "trace.rank0.sqlite", grad_exps=[(-4, 10)], scales=[2.0 ** 16] * 8)
    synthetic_trace(run / "trace.rank1.sqlite", grad_exps=[(-4, 10)], scales=scales, skipped=[1] * 8, grad_nan=5)
    rep = build_report(run)
    assert not rep.diagnosis.broke
    (line,) = [n for n in rep.notes if n.startswith("rank ")]
    assert "Training broke at step 0: the GradScaler skipped all 8 steps" in line, line


def test_module_expr():
    assert module_expr("blocks.1.attn") == "model.blocks[1].attn"
    assert module_expr("net.2") == "model.net[2]"
    assert module_expr("") == "model"
    assert module_expr("a.<b>") == "model.get_submodule('a.<b>')"


def test_a_second_models_fix_says_which_object_it_names():
    # a GAN whose G and D are both nn.Sequential: D's layers are "Sequential:0", written sequential[0];
    # the snippet says what `sequential` is (it said nothing, and `model` would be G)
    assert module_expr("Sequential:0", types={"Sequential:": "Sequential"}) == "sequential[0]"
    hint = root_hint(["Sequential:0", "Sequential:2"], {"": "Sequential"})
    assert hint == " (`sequential`: the Sequential model your script called after the first one watched)"
    assert root_hint(["net.2"], {"": "Net"}) == " (`model`: your Net object)"
    assert root_hint(["D:0", "G:1"], {"": "Net"}) == ""  # two other objects: each expression names its own


# -- real traces ---------------------------------------------------------------------------------------
def test_overflow_model_advice_names_the_fix(tmp_path):
    rep = build_report(overflow_trace(tmp_path / "t.sqlite"))
    text = "\n".join(rep.advice)
    assert "`ampdoctor.keep_fp32(model.mid)`" in text
    assert "torch.autocast(x.device.type, enabled=False)" in text
    assert "6.29e+04" in text or "abs-max" in text


def test_bisect_culprits_and_attention_drilldown_win(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    overflow_trace(run / "trace.sqlite")
    (run / "bisect.json").write_text(json.dumps({
        "verdict": "culprit", "culprits": ["blocks.1.attn"], "failure": {"step": 4, "reason": "nonfinite_loss"},
        "ops": [{"layer": "blocks.1.attn", "op": "aten.matmul", "where": "model.py:42", "absmax": 1.2e5},
                {"layer": "blocks.1.attn", "op": "aten._softmax", "where": "model.py:44", "absmax": 1.0}],
        "trials": []}))
    text = "\n".join(build_report(run).advice)
    assert "`ampdoctor.keep_fp32(model.blocks[1].attn)`" in text and "bisect verified" in text
    assert "model.py:42" in text and "1/sqrt(head_dim)" in text and "1.20e+05" in text


# bf16: 3.4e38 is finite in FP32 (max 3.40282e38) and beyond bf16's max (3.38953e38); 1e39 is Inf in FP32 already
@pytest.mark.parametrize("fmt,gain", [("fp16", 2e5), ("bf16", 3.4e38), ("fp8_e4m3fn", 1e3), ("fp8_e5m2", 1e5)])
def test_readiness_phrasing(tmp_path, fmt, gain):
    from ampdoctor import FORMATS
    if fmt not in FORMATS:
        pytest.skip(f"torch has no {fmt}")
    rep = build_report(fp32_trace(tmp_path / "t.sqlite", fmt, gain))
    ready = readiness(rep)
    assert ready is not None and ready["format"] == FORMATS[fmt].name
    text = "\n".join(rep.advice)
    assert f"Would overflow in {FORMATS[fmt].name} (max {FORMATS[fmt].max:.6g}): outputs of 1 " in text, text
    assert "no autocast" in text and "`ampdoctor.keep_fp32(model[1])`" in text


def test_readiness_is_off_for_autocast_runs(tmp_path):
    assert readiness(build_report(overflow_trace(tmp_path / "t.sqlite"))) is None


def test_readiness_does_not_count_values_already_nonfinite_in_fp32_as_overflow(tmp_path):
    # a diverged FP32 run: a weight already Inf in FP32 was listed as 'would overflow in fp16'
    import numpy as np
    import torch
    from torch import nn

    import ampdoctor
    from ampdoctor.formats import get_format

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    w0 = np.full((4, 4), 0.5, np.float32)
    w0[0, 0] = np.inf  # broken in FP32
    w1 = np.full((4, 4), 0.25, np.float32)
    w1[1, 1] = 1e5  # finite, beyond fp16's max
    with torch.no_grad():
        for lin, w in zip(model, (w0, w1)):
            lin.weight.copy_(torch.from_numpy(w))
            lin.bias.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite"), format="fp16"):
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    rep = build_report(tmp_path / "t.sqlite")

    # numpy: forward, backward of the sum, SGD at lr 0 (p - 0 * grad: NaN where the gradient is Inf)
    x, b = np.ones((2, 4), np.float32), np.zeros(4, np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        h = x @ w0.T + b
        y = h @ w1.T + b
        gy = np.ones_like(y)
        gh = gy @ w1
        values = {("activation", "0"): [h], ("activation", "1"): [y], ("gradient", "0"): [gh], ("gradient", "1"): [gy],
                  ("weight_grad", "0"): [gh.T @ x, gh.sum(0)], ("weight_grad", "1"): [gy.T @ h, gy.sum(0)],
                  ("weight", "0"): [w0 - 0 * (gh.T @ x), b], ("weight", "1"): [w1 - 0 * (gy.T @ h), b]}
    fmax = get_format("fp16").max
    counts = {k: (sum(int(np.isnan(v).sum()) for v in vs), sum(int(np.isinf(v).sum()) for v in vs),
                  sum(int((np.isfinite(v) & (np.abs(v) > fmax)).sum()) for v in vs)) for k, vs in values.items()}
    assert {(r.kind, r.layer): (r.nan, r.inf, r.overflow) for r in rep.layers} == counts
    assert counts[("weight", "0")] == (0, 1, 0) and counts[("weight", "1")] == (4, 0, 1)

    ready = readiness(rep)
    over = {k: [r.layer for r in rows] for k, rows in ready["overflow"].items()}
    assert over == {k: [n for (kk, n), c in counts.items() if kk == k and c[2]] for k in ("gradient", "weight", "weight_grad")}
    assert over["weight"] == ["1"]
    nonfinite = {k: [r.layer for r in rows] for k, rows in ready["nonfinite"].items()}
    assert nonfinite == {k: [n for (kk, n), c in counts.items() if kk == k and (c[0] or c[1])]
                         for k in ("activation", "weight", "weight_grad")}
    text = "\n".join(rep.advice)
    assert "measured against fp16: 2 of 2 layers would overflow, 0 would underflow; 2 already had NaN/Inf in FP32." in text
    assert "weights of 1 (abs-max 1.00e+05, 5% over);" in text and "weights of 0 (abs-max" not in text, text  # 1 of 20
    assert "Already NaN/Inf in FP32, so not counted as overflow" in text and "weights of 0 (0 NaN, 1 Inf), 1 (4 NaN, 0 Inf)" in text
    assert "Keep 0 in FP32 when you switch on autocast" not in text  # no output overflowed: only Inf from the weight


@pytest.mark.slow
def test_grad_underflow_loss_scale_range_trains(tmp_path):
    """fixtures/grad_underflow.py stalls at --loss-scale 1 (fp16 gradients flush to zero). A readiness run
    (every layer forced to FP32 through the trial configuration, measured against fp16) gives the loss-scale
    range; the recommended scale and both ends, applied with --loss-scale, train below TRAINS_BELOW."""
    script = FIXTURES / "grad_underflow.py"
    consts = _fixture_constants("grad_underflow.py")
    trains_below = consts["TRAINS_BELOW"]

    # the autocast run: the gradients are all zero, and the advice says so with the least scale that helps
    auto = tmp_path / "auto"
    subprocess.run([sys.executable, "-m", "ampdoctor", "run", "--out", str(auto), str(script)], env=_env(),
                   check=True, capture_output=True, text=True, timeout=300)
    auto_text = "\n".join(build_report(auto).advice)
    assert "was exactly 0" in auto_text and "2**11" in auto_text

    # the readiness run
    trace = tmp_path / "fp32" / "trace.sqlite"
    env = _env()
    env["AMPDOCTOR_CONFIG"] = json.dumps({"trace": str(trace), "format": "fp16", "force_fp32": ["net"]})
    subprocess.run([sys.executable, str(script)], env=env, check=True, capture_output=True, text=True, timeout=300)
    rep = build_report(trace)
    rng = loss_scale_range(rep)
    assert rng is not None, rep.advice
    lo, hi, rec = rng
    assert 1.0 < lo <= rec <= hi
    assert any(a.startswith("Would underflow in fp16") for a in rep.advice)
    k = int(math.log2(rec))
    assert any(f"init_scale={2 ** k if 0 <= k <= 24 else f'2.0**{k}'}," in a for a in rep.advice)

    def final(scale: float) -> float:
        out = subprocess.run([sys.executable, str(script), "--loss-scale", repr(scale)], env=_env(), check=True,
                             capture_output=True, text=True, timeout=300).stdout
        return _final_loss(out)

    assert final(1.0) > consts["STALLS_ABOVE"]  # the fixture does stall without a scale
    for scale in (rec, lo, hi):
        assert final(scale) < trains_below, f"loss scale {scale:g} from {rng} did not train"


@pytest.mark.slow
def test_overflow_fixture_advice_names_the_culprit(tmp_path):
    out = tmp_path / "run"
    subprocess.run([sys.executable, "-m", "ampdoctor", "run", "--out", str(out), str(FIXTURES / "linear_overflow.py")],
                   env=_env(), check=True, capture_output=True, text=True, timeout=300)
    rep = build_report(out)
    text = "\n".join(rep.advice)
    assert "`ampdoctor.keep_fp32(model.net[2])`" in text
    assert "65504" in text  # the recorded numbers are quoted
    # net.2's output holds Inf: said so, with the largest finite value, not as "-inf bits" of headroom
    assert "its output overflowed to Inf (fp16 max 65504; largest finite abs-max" in text and "-inf bits" not in text
    assert (out / "report.html").exists()


def test_not_precision_verdict_drops_the_fp32_fix(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    overflow_trace(run / "trace.sqlite")
    (run / "bisect.json").write_text(json.dumps({"verdict": "not_precision", "culprits": [], "trials": []}))
    text = "\n".join(build_report(run).advice)
    assert "keep_fp32" not in text.split("Gradients of")[0]
    assert "not a precision problem" in text


def test_fix_expression_indexes_a_moduledict_with_a_string_key(tmp_path):
    """`nn.ModuleDict({str(i): ...})`: the fix said `ampdoctor.keep_fp32(model.stages[1])`, a KeyError
    when pasted; a numeric child of a plain module (`add_module("1", ...)`) is not indexable either."""
    import torch
    from torch import nn

    import ampdoctor
    from ampdoctor.naming import module_expr

    assert module_expr("stages.1", types={"": "Net", "stages": "ModuleDict"}) == "model.stages['1']"
    assert module_expr("net.2", types={"": "Net", "net": "Sequential"}) == "model.net[2]"
    assert module_expr("blocks.0.attn", types={"blocks": "ModuleList"}) == "model.blocks[0].attn"
    assert module_expr("0", types={"": "Net"}) == "model.get_submodule('0')"
    assert module_expr("net.2") == "model.net[2]"

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(4, 16)
            self.stages = nn.ModuleDict({str(i): nn.Linear(16, 16) for i in range(3)})
            with torch.no_grad():
                self.stages["1"].weight.mul_(100.0)
            self.ln = nn.LayerNorm(16)
            self.out = nn.Linear(16, 1)

        def forward(self, x):
            h = self.inp(x)
            for k in ("0", "1", "2"):
                h = self.stages[k](h)
            return self.out(self.ln(h))

    def train():
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.Adam(model.parameters(), 1e-3)
        scaler = torch.amp.GradScaler("cpu")
        for step in range(40):
            x = torch.randn(16, 4) * (1 + 50 * step)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), torch.randn(16, 1))
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

    res = ampdoctor.bisect(train, out=tmp_path, drill=False)
    assert res["verdict"] == "culprit" and res["culprits"], res
    fixes = [a.split("ampdoctor.keep_fp32(", 1)[1][:-1] for a in res["advice"] if "ampdoctor.keep_fp32(" in a]
    assert fixes and any("stages[" in f for f in fixes), fixes
    model = Net()
    for f in fixes:
        ampdoctor.keep_fp32(eval(f, {"model": model}))
    report = build_report(tmp_path / "trials" / "00-baseline")
    assert "stages['" in " ".join(report.advice) and "stages[1]" not in " ".join(report.advice), report.advice


def test_no_keep_fp32_for_a_run_that_was_fp32_throughout(tmp_path):
    """A pure-FP32 run that diverges, reported against fp32 (or bf16): the advice said to keep the
    first producer in FP32 (with an autocast(enabled=False) snippet), which it already was."""
    import torch
    from torch import nn

    import ampdoctor
    from ampdoctor.report.culprit import culprits

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), 1e-3)
    with ampdoctor.watch(model, format="fp32", trace=str(tmp_path / "t.sqlite")):
        for _ in range(8):
            x = torch.randn(16, 4) * 100
            loss = nn.functional.mse_loss(model(x), x[:, :1])
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = build_report(tmp_path / "t.sqlite")
    assert report.diagnosis.broke and report.diagnosis.first_nonfinite, report.diagnosis
    assert culprits(report) == ([], "")
    text = " ".join(report.advice)
    assert "keep_fp32" not in text and "produced in FP32" in text, report.advice


def test_headroom_of_a_layer_with_no_finite_value_is_not_infinite(tmp_path):
    """An output that is all NaN has no finite value: its abs-max over finite values is 0, which read
    as ``inf`` bits of headroom beside millions of NaN (seen on an HF Trainer run), and the culprit's
    evidence said "overflowed to Inf". An output whose finite values are all zero keeps ``inf``."""
    import torch
    from torch import nn

    import ampdoctor
    from ampdoctor.report.culprit import culprit_advice
    from ampdoctor.report.phrasing import fmt_bits

    class Times(nn.Module):
        def __init__(self, v: float):
            super().__init__()
            self.v = v

        def forward(self, x):
            return x * self.v

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Times(0.0), Times(float("nan")))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    trace = tmp_path / "t.sqlite"
    with ampdoctor.watch(model, trace=str(trace)):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(3, 4)).float().sum()  # one step: SGD's step turns the weights NaN (0 * NaN)
        loss.backward()
        opt.step()
    rep = build_report(trace)
    rows = {(r.layer, r.kind): r for r in rep.layers}
    zero, nan = rows[("1", "activation")], rows[("2", "activation")]
    assert zero.absmax == 0 and zero.nan == 0 and zero.headroom_bits == math.inf and fmt_bits(zero.headroom_bits) == "inf"
    assert nan.absmax == 0 and nan.nan == 12 and math.isnan(nan.headroom_bits) and fmt_bits(nan.headroom_bits) == "-"
    layer = next(d for d in json.loads(rep.to_json())["layers"] if d["layer"] == "2" and d["kind"] == "activation")
    assert layer["headroom_bits"] is None
    assert rep.diagnosis.first_nonfinite["layer"] == "2"
    text = "\n".join(culprit_advice(rep))
    assert "its output held no finite value (every value NaN, 12 NaN values" in text and "Inf" not in text, text


def test_a_scale_that_only_fell_is_not_told_it_keeps_growing_into_overflow(tmp_path):
    """A 4-step run whose forward overflowed from step 0 (the loss NaN every step, the scale only halving)
    was told "the scale keeps growing into overflow. A longer growth_interval ... skips fewer steps"."""
    scales = [2.0 ** (15 - i) for i in range(4)]
    p = synthetic_trace(tmp_path / "nan.sqlite", grad_exps=[(-4, 10)], scales=scales, skipped=[1] * 4,
                        losses=[float("nan")] * 4)
    rep = build_report(p)
    h = scaler_health(rep)
    assert (h.state, h.nonfinite_loss_skips, h.overflow_after_startup) == ("forward", 4, 0)
    text = "\n".join(rep.advice)
    assert "keeps growing" not in text and "growth_interval" not in text, text
    assert "GradScaler: 4 of 4 steps skipped. The loss itself was NaN/Inf in 4 of the skipped steps" in text, text
    # finite losses, one step taken, then three skips while the scale only fell: persistent, not frequent
    p = synthetic_trace(tmp_path / "fell.sqlite", grad_exps=[(-4, 10)], scales=[2.0 ** 16] + scales[1:],
                        skipped=[0, 1, 1, 1])
    rep = build_report(p)
    h = scaler_health(rep)
    assert (h.state, h.overflow_after_startup) == ("persistent", 3)
    text = "\n".join(rep.advice)  # 3 of 4 steps: too few for "most of the last 10", which it said
    assert "3 after start-up, again and again while the scale only fell: persistent" in text, text


def test_a_scale_that_grows_back_into_overflow_is_frequent(tmp_path):
    # growth every 8 steps, each growth skipped at the next step: 4 skips in 40, 1 in the last 10
    scales, skipped = [], []
    for i in range(40):
        grow, skip = i % 8 == 6, i % 8 == 7
        scales.append(2.0 ** 17 if grow else 2.0 ** 16)
        skipped.append(int(skip))
    p = synthetic_trace(tmp_path / "t.sqlite", grad_exps=[(-4, 10)], scales=scales, skipped=skipped)
    rep = build_report(p)
    h = scaler_health(rep)
    assert (h.state, h.overflow_after_startup) == ("frequent", 5)
    assert any("keeps growing into overflow" in a for a in rep.advice)


def test_fix_of_a_pure_half_model_does_not_turn_autocast_off(tmp_path):
    """A pure ``.half()`` model has no autocast to turn off: the report's plain-PyTorch fix said
    ``with torch.autocast(..., enabled=False): out = layer(x.float())``, which fails there (a float32
    input to float16 weights). It says to convert the layer to FP32 and cast around its call, as
    bisect's fix does, in the terminal advice and in the HTML fix section."""
    import torch
    from torch import nn

    import ampdoctor
    from ampdoctor.report.html import render_html

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    with torch.no_grad():
        model[1].weight.mul_(1000.0)
    model.half()
    opt = torch.optim.SGD(model.parameters(), 1e-4)
    with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite")):
        for _ in range(3):
            x = (torch.randn(16, 4) * 100).half()
            loss = model(x).float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = build_report(tmp_path / "t.sqlite")
    assert (report.diagnosis.first_nonfinite or {}).get("layer") == "1", report.diagnosis
    fix = next(a for a in report.advice if "keep_fp32(model[1])" in a)
    assert "autocast(" not in fix and "`model[1].float()` once" in fix, fix
    assert "`y = model[1](x.float()).to(x.dtype)`" in fix and "float16" in fix, fix
    page = render_html(report)
    section = page[page.index('id="fix"'):]
    section = section[:section.index("</section>")]
    assert "enabled=False" not in section and "model[1].float()" in section and ".to(x.dtype)" in section, section

    # the recipe works: the layer in FP32 between half layers, its output cast back
    model[1].float()
    h = model[0](x)
    y = model[1](h.float()).to(h.dtype)
    assert y.dtype == torch.float16 and model[1].weight.dtype == torch.float32


def test_a_scale_that_falls_below_one_and_then_steps_is_not_called_a_layer_fault(tmp_path):
    """A loss 1e7 times too large: the GradScaler skips down to a scale below 1, and from there the steps
    go through. Nothing produces Inf; the gradients need a scale below 1. The advice said "overflow at
    every scale ... fix that layer; changing init_scale will not help"."""
    scales = [2.0 ** (15 - i) for i in range(22)] + [2.0 ** -7] * 8
    skipped = [1] * 22 + [0] * 8
    p = synthetic_trace(tmp_path / "below.sqlite", grad_exps=[(10, 30)], scales=scales, skipped=skipped)
    rep = build_report(p)
    h = scaler_health(rep)
    assert h.state == "below_one"
    text = "\n".join(rep.advice)
    assert "changing init_scale will not help" not in text, text
    assert "only a scale below 1 fits them" in text, text
    assert "nothing produced Inf/NaN" in text, text


def test_a_scale_below_one_after_nan_losses_does_not_say_nothing_produced_nan(tmp_path):
    """The same fall below 1, but the loss was NaN in some of the skipped steps (a diverging run): the
    advice said "nothing produced Inf/NaN" in the item that also says the loss was NaN/Inf."""
    scales = [2.0 ** (15 - i) for i in range(22)] + [2.0 ** -7] * 8
    skipped = [1] * 22 + [0] * 8
    losses = [1.0] * 10 + [float("nan")] * 12 + [1.0] * 8
    p = synthetic_trace(tmp_path / "below.sqlite", grad_exps=[(10, 30)], scales=scales, skipped=skipped, losses=losses)
    rep = build_report(p)
    assert scaler_health(rep).state == "below_one"
    item = next(a for a in rep.advice if a.startswith("GradScaler:"))
    assert "The loss itself was NaN/Inf in 12 of the skipped steps" in item, item
    assert "nothing produced Inf/NaN" not in item and "steps went through at that scale" in item, item


def test_bf16_gradients_far_below_its_range_are_not_said_to_fit(tmp_path):
    """bf16 has FP32's exponent range, but gradients of a loss scaled down by far (binade 2**-130, below
    bf16's smallest normal 2**-126) still underflow: the advice said "no loss scaling needed"."""
    p = synthetic_trace(tmp_path / "tiny.sqlite", grad_exps=[(-130, 50)], scales=[None] * 4, fmt="bf16",
                        dtype="bfloat16")
    text = "\n".join(build_report(p).advice)
    assert "no loss scaling needed" not in text, text
    assert "Gradients underflow bf16 at scale 1" in text, text


def test_fix_snippets_for_names_that_are_keywords_or_hold_a_colon():
    from ampdoctor.naming import module_expr, root_hint

    types = {"": "Net", "enc": "ModuleDict", "enc.class": "Sequential", "heads": "ModuleDict",
             "heads.task:a": "Linear", "D:": "D", "D:net": "Sequential", "D:net.2": "Linear"}
    assert module_expr("enc.class.0", types=types) == "model.get_submodule('enc.class.0')"  # was model.enc.class[0]
    assert module_expr("heads.task:a", types=types) == "model.get_submodule('heads.task:a')"  # was heads.task.a
    assert root_hint(["heads.task:a"], types) == " (`model`: your Net object)"
    assert module_expr("D:net.2", types=types) == "d.net[2]"  # a second model's layer, as before
    assert "`d`: the D model" in root_hint(["D:net.2"], types)
    for expr in (module_expr("enc.class.0", types=types), module_expr("heads.task:a", types=types)):
        compile(expr, "<fix>", "eval")


# -- advice that fits the run: GradScaler snippets only where one ran; the most useful fix first -----------
def _diverging_run(path: Path, mode: str, steps: int = 8):
    """A small MLP whose learning rate is far too high: the loss grows ~10x a step until it overflows.
    ``mode``: fp16/bf16 CPU autocast (no GradScaler), or a pure ``.bfloat16()`` model."""
    import torch
    from torch import nn

    import ampdoctor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    if mode == "pure_bf16":
        model = model.bfloat16()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    with ampdoctor.watch(model, trace=str(path), format="fp16" if mode == "fp16" else "bf16"):
        for _ in range(steps):
            x = torch.randn(32, 4) * 3
            y = x.sum(1, keepdim=True)
            if mode == "pure_bf16":
                out = model(x.bfloat16())
            else:
                with torch.autocast("cpu", dtype=torch.float16 if mode == "fp16" else torch.bfloat16):
                    out = model(x)
            loss = nn.functional.mse_loss(out.float(), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return build_report(path)


@pytest.mark.parametrize("mode", ["fp16", "bf16", "pure_bf16"])
def test_a_divergence_without_a_grad_scaler_is_told_to_clip_without_one(tmp_path, mode):
    """The divergence advice said `scaler.unscale_(opt)` to runs that have no GradScaler (bf16, fp32), and came
    after the keep_fp32 of the layer that first overflowed (a suspect): the learning rate is the fix, first."""
    rep = _diverging_run(tmp_path / "t.sqlite", mode)
    assert scaler_health(rep).state == "none"
    first = rep.advice[0]
    assert first.startswith("The loss grew from ") and "an optimisation divergence" in first, rep.advice
    assert "`torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)` before `opt.step()`" in first, first
    text = "\n".join(rep.advice)
    assert "unscale_" not in text and "scaler." not in text, text
    if mode != "fp16":  # bf16 has FP32's range: no GradScaler to recommend either
        assert "GradScaler" not in text, text
    assert any("keep_fp32(" in a for a in rep.advice[1:]), rep.advice  # the suspect is still named, after


def test_a_divergence_with_a_grad_scaler_unscales_before_clipping(tmp_path):
    losses = [1.0, 0.5, 4.0, 40.0, 400.0] + [float("nan")] * 4
    p = synthetic_trace(tmp_path / "t.sqlite", grad_exps=[(-4, 100)], scales=[2.0 ** 16] * 5 + [2.0 ** 15, 2.0 ** 14,
                        2.0 ** 13, 2.0 ** 12], skipped=[0] * 5 + [1] * 4, losses=losses)
    rep = build_report(p)
    assert rep.diagnosis.broke and rep.diagnosis.step == 5, rep.diagnosis
    first = rep.advice[0]
    assert first.startswith("The loss grew from 0.5 (step 1) to 400 (step 4)"), rep.advice
    assert ("`scaler.unscale_(opt); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)` before "
            "`scaler.step(opt)`") in first, first
    p2 = synthetic_trace(tmp_path / "t2.sqlite", grad_exps=[(-4, 100)], scales=[None] * 9, losses=losses)
    rep2 = build_report(p2)
    assert rep2.advice[0].startswith("The loss grew from 0.5 (step 1) to 400 (step 4)"), rep2.advice
    assert "unscale_" not in "\n".join(rep2.advice) and "before `opt.step()`" in rep2.advice[0], rep2.advice


def test_a_nonfinite_gradient_from_the_loss_blames_the_loss_scale_only_when_there_is_one(tmp_path):
    from ampdoctor.trace import TraceWriter

    def trace(path: Path, scaled: bool, last_loss: float = 1.5) -> Path:
        w = TraceWriter(path)
        w.set_meta(format="fp16", every=1, status="finished", argv=["synthetic"])
        w.add_layers([(0, "lin", "Linear", 0, 1, None)])
        for step in range(3):
            w.add_step((step, [1.0, 1.0, last_loss][step], 65536.0 if scaled else None,
                        (1 if step == 2 else 0) if scaled else None, step + 1, 1, float(step)))
        w.add_event(2, "first_nonfinite", "lin", kind="gradient", call=0, producers=1, from_loss=True, scaled=scaled)
        w.commit()
        w.close()
        return path

    text = "\n".join(build_report(trace(tmp_path / "a.sqlite", False)).advice)
    assert "from the loss was non-finite at step 2: the loss overflowed" in text, text
    # (a scaled one with a finite loss: test_a_scaled_gradient_from_the_loss_says_so_when_picked_from_the_scalers_skips)
    # the loss itself Inf in forward: its computation overflowed, not its gradient times the scale (which it said)
    text = "\n".join(build_report(trace(tmp_path / "c.sqlite", True, float("inf"))).advice)
    assert "The loss itself was non-finite at step 2 while every watched layer's output was finite: its " \
           "computation, outside the model, overflowed; compute the loss in FP32" in text, text
    assert "times the loss scale" not in text, text


def test_a_scaled_gradient_from_the_loss_says_so_when_picked_from_the_scalers_skips(tmp_path):
    """The gradient events of skipped steps are written only while a GradScaler scales the loss and do not
    say so: the first non-finite value picked from them lost "(scaled by the GradScaler)", and the advice
    its "(times the loss scale)"."""
    from ampdoctor.trace import TraceWriter

    w = TraceWriter(tmp_path / "t.sqlite")
    w.set_meta(format="fp16", every=1, status="finished", argv=["synthetic"])
    w.add_layers([(0, "lin", "Linear", 0, 1, None)])
    for step in range(16):
        skip = int(step >= 4)
        w.add_step((step, 1.0, 2.0 ** (16 - max(0, step - 3)), skip, min(step + 1, 4), 1, float(step)))
        if skip:
            w.add_event(step, "grad_nonfinite", "lin", kind="gradient", from_loss=True)
    w.commit()
    w.close()
    rep = build_report(tmp_path / "t.sqlite")
    assert (rep.diagnosis.broke, rep.diagnosis.reason) == (True, "skipped_steps"), rep.diagnosis
    assert rep.diagnosis.first_nonfinite["scaled"] is True
    assert any(x.endswith("from the loss (scaled by the GradScaler).") for x in rep.diagnosis.lines), rep.diagnosis.lines
    assert "the loss (times the loss scale) overflowed" in "\n".join(rep.advice), rep.advice


# -- a huge init_scale: start-up backoffs, then healthy training ---------------------------------------------
def _scaler_trace(path: Path, scales: list[float], skipped: list[int], *, loss_events: bool = False) -> Path:
    """A GradScaler's timeline alone, optimizer steps counted as taken (synthetic_trace counts one a step);
    ``loss_events``: each skipped step's gradient came in non-finite from the (scaled) loss."""
    from ampdoctor.trace import TraceWriter

    w = TraceWriter(path)
    w.set_meta(format="fp16", every=1, status="finished", argv=["synthetic"])
    w.add_layers([(0, "lin", "Linear", 0, 1, None)])
    taken = 0
    for step, (scale, skip) in enumerate(zip(scales, skipped)):
        taken += 0 if skip else 1
        w.add_step((step, 0.5, scale, skip, taken, 1, float(step)))
        if skip and loss_events:
            w.add_event(step, "grad_nonfinite", "lin", kind="gradient", from_loss=True)
    w.commit()
    w.close()
    return path


def test_a_huge_init_scale_is_start_up_backoffs_in_the_diagnosis_too(tmp_path):
    """GradScaler(init_scale=2**40) on a healthy model: 22 skips while the scale halves to 2**18, then steps.
    The report said "Training broke at step 0: ... persistent gradient overflow"; scaler_health says start-up."""
    scales = [2.0 ** (39 - i) for i in range(22)] + [2.0 ** 18] * 18
    p = _scaler_trace(tmp_path / "t.sqlite", scales, [1] * 22 + [0] * 18)
    rep = build_report(p)
    assert scaler_health(rep).state == "startup"
    assert not rep.diagnosis.broke and rep.diagnosis.lines[0] == "Training did not break in the 40 steps seen."
    assert ("GradScaler skipped 22 of 40 steps: 22 start-up backoffs (its scale fell from 2**40 to 2**18 before the "
            "first optimizer step).") in rep.diagnosis.lines, rep.diagnosis.lines
    text = "\n".join(rep.diagnosis.lines + rep.advice)
    assert "persistent" not in text and "broke" not in text and "are normal" not in text, text
    line = next(a for a in rep.advice if "start-up backoffs" in a)
    assert line.startswith("GradScaler: 22 of 40 steps skipped: 22 start-up backoffs, the scale falling from 2**40 to "
                           "2**18 before the first optimizer step, then training went on: not a failure"), line
    assert line.endswith("A smaller init_scale avoids them: the default 2**16 (`torch.amp.GradScaler()`), which these "
                         "gradients fit."), line
    # settling at 2**12 instead: the default would still back off 4 times
    scales = [2.0 ** (39 - i) for i in range(28)] + [2.0 ** 12] * 12
    p = _scaler_trace(tmp_path / "t2.sqlite", scales, [1] * 28 + [0] * 12)
    line = next(a for a in build_report(p).advice if "start-up backoffs" in a)
    assert "from 2**40 to 2**12" in line and line.endswith("which would take 4 of them."), line
    # an ordinary start (the default 2**16, three backoffs) is still normal
    scales = [2.0 ** 15, 2.0 ** 14, 2.0 ** 13] + [2.0 ** 13] * 7
    p = _scaler_trace(tmp_path / "t3.sqlite", scales, [1, 1, 1] + [0] * 7)
    assert "3 start-up backoffs (2**16 -> 2**13) are normal" in "\n".join(build_report(p).advice)


def test_a_run_that_ended_inside_a_long_backoff_is_told_what_it_was(tmp_path):
    """The run ended after 22 skips whose scale halved each time (longer than the oracle's start-up grace of 20:
    a failure, as bisect's oracle counts it): said as such, not as "persistent gradient overflow"; the advice
    does not tell the loss to go to FP32 for the scale's overflow."""
    p = _scaler_trace(tmp_path / "t.sqlite", [2.0 ** (39 - i) for i in range(22)], [1] * 22, loss_events=True)
    rep = build_report(p)
    assert (rep.diagnosis.broke, rep.diagnosis.step, rep.diagnosis.reason) == (True, 0, "skipped_steps")
    assert rep.diagnosis.lines[0] == (
        "Training broke at step 0: the GradScaler skipped all 22 steps, its scale falling at each from 2**40 to 2**18: "
        "start-up backoffs that had not ended after more than 20 steps (an init_scale far above what the gradients fit, "
        "or gradients that overflow at every scale).")
    text = "\n".join(rep.advice)
    assert "compute the loss in FP32" not in text and "persistent" not in text, text
    assert "an init_scale of 2**40 is above the default 2**16: a smaller one ends them sooner." in text, text


def test_a_real_run_with_init_scale_2_to_the_40_is_not_broken(tmp_path):
    import torch
    from torch import nn

    import ampdoctor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)
    gen = torch.Generator().manual_seed(1)
    with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite")):
        for _ in range(40):
            x = torch.randn(16, 8, generator=gen)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), x[:, :1] * 3)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    rep = build_report(tmp_path / "t.sqlite")
    h = scaler_health(rep)
    assert h.state in ("startup", "occasional") and h.startup_backoffs >= 20, h
    assert not rep.diagnosis.broke and rep.diagnosis.first_nonfinite is None, rep.diagnosis
    settled = f"2**{40 - h.startup_backoffs}"
    assert any(x.startswith(f"GradScaler skipped {h.skipped} of 40 steps: {h.startup_backoffs} start-up backoffs "
                            f"(its scale fell from 2**40 to {settled} before") for x in rep.diagnosis.lines), rep.diagnosis
    text = "\n".join(rep.advice)
    assert "not a failure" in text and "persistent" not in text and "compute the loss in FP32" not in text, text


def test_plain_fix_of_a_half_module_warns_that_a_tied_weight_turns_fp32_for_both():
    """The plain-PyTorch fix of a module whose weights are stored in half precision converts it with
    .float(), which a tied weight (an LM head's, the embedding's) would carry into the other module:
    the snippet says so and points to keep_fp32, which keeps the tie."""
    from ampdoctor.naming import plain_fix

    half = plain_fix("model.lm_head", "float16")
    assert "`model.lm_head.float()`" in half and "tied" in half and "keep_fp32 keeps the tie" in half
    assert "tied" not in plain_fix("model.lm_head", None)


def test_a_loss_that_grows_while_the_scaler_backs_off_is_called_a_divergence(tmp_path):
    """A learning rate too high under fp16 autocast + GradScaler: the growing gradients make the scaler
    skip (the oracle's break, at step 6, where the loss had grown 6-fold only), and the loss goes on
    growing 1e5-fold over the steps it still takes before it turns Inf. Only the losses before the
    break counted, so the first advice was keep_fp32 of the first layer to overflow; the divergence
    comes first now."""
    import torch
    from torch import nn

    import ampdoctor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    scaler = torch.amp.GradScaler("cpu")
    with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite")):
        for _ in range(40):
            x = torch.randn(32, 4) * 3
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            loss = nn.functional.mse_loss(out.float(), x.sum(1, keepdim=True))
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    rep = build_report(tmp_path / "t.sqlite")
    assert rep.diagnosis.reason == "skipped_steps", rep.diagnosis
    first = rep.advice[0]
    assert first.startswith("The loss grew from") and "while the GradScaler skipped steps" in first, rep.advice
    assert "scaler.unscale_(opt)" in first, first
    line = rep.diagnosis.lines[0]
    assert "a divergence that broke the GradScaler" in line and "persistent gradient overflow" not in line, line


def test_start_up_backoffs_and_a_later_skip_say_the_count_once(tmp_path):
    # two bullets both began "GradScaler: 2 of 10 steps skipped"
    scales = [2.0 ** 15] * 5 + [2.0 ** 14] * 5
    p = synthetic_trace(tmp_path / "t.sqlite", grad_exps=[(-4, 100)], scales=scales, skipped=[1, 0, 0, 0, 0, 1, 0, 0, 0, 0])
    said = [a for a in build_report(p).advice if "skip" in a]
    assert sum(a.startswith("GradScaler: 2 of 10 steps skipped") for a in said) == 1, said
    assert any(a.startswith("GradScaler: 2 of 10 steps skipped: 1 start-up backoff (2**16 -> 2**15) is normal;")
               and a.endswith("avoids it.") for a in said), said
    assert any(a.startswith("Of those skips, 1 after start-up: occasional overflow") for a in said), said


def test_the_first_steps_scale_is_the_grad_scalers_init_scale(tmp_path):
    # GradScaler(init_scale=4, growth_interval=1) grows at step 0: its row holds 8 (after update()), and the
    # first step was unscaled with 8 instead of the 4 its backward ran with (one binade low)
    import torch
    from torch import nn

    import ampdoctor
    from ampdoctor.report.unscaled import _used_scales

    torch.manual_seed(0)
    m = nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    sc = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=1)
    with ampdoctor.watch(m, trace=tmp_path / "t.sqlite"):
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(torch.randn(2, 4)).float().pow(2).mean()
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
            opt.zero_grad()
    rep = build_report(tmp_path / "t.sqlite")
    assert [t["scale"] for t in rep.timeline] == [8.0, 16.0, 32.0]
    assert rep.meta["first_scale"] == {"step": 0, "scale": 4.0}
    assert _used_scales(rep) == {0: 4.0, 1: 8.0, 2: 16.0}
    # a scaler used before the watch began: nothing said, the first step's scale is inferred as before
    sc2 = torch.amp.GradScaler("cpu", init_scale=4.0)
    sc2.scale(torch.ones(()))
    with ampdoctor.watch(nn.Linear(4, 1), trace=tmp_path / "u.sqlite") as w:
        sc2.scale(w.model(torch.randn(2, 4)).sum()).backward()
    assert "first_scale" not in build_report(tmp_path / "u.sqlite").meta


def test_absmax_just_past_the_fp16_max_is_not_printed_as_the_max(tmp_path):
    """An fp32 output of 65505 lies past fp16's max 65504 (it rounds back to 65504 when cast, 65520 would
    not): the report must not print both as 6.55e+04. Whole numbers from 1e4 up to 1e5."""
    import torch
    from torch import nn

    import ampdoctor
    from ampdoctor.report.phrasing import fmt_num
    from ampdoctor.report.text import render_text

    assert [fmt_num(v) for v in (65504.0, 65505.0, -65519.9, 12345.4, 99999.6, 1e5, 0.00123)] == \
        ["65504", "65505", "-65520", "12345", "1.00e+05", "1.00e+05", "0.00123"]

    class Const(nn.Module):
        def forward(self, x):
            return x * 0 + 65505.0

    model = nn.Sequential(nn.Linear(4, 4), Const())
    trace = tmp_path / "t.sqlite"
    with ampdoctor.watch(model, trace=str(trace)):
        model(torch.randn(3, 4)).sum().backward()
    text = " ".join(render_text(build_report(trace)).split())
    assert " 65505 " in text and "6.55e+04" not in text, text


def test_skips_that_stopped_once_the_scale_settled_are_not_persistent_overflow(tmp_path):
    """Gradients that grew during training: skips after start-up while the scale only fell (steps 10-39),
    then none for the last 20 steps. The advice said "persistent overflow. The scale fell to 2**6 without
    the overflow stopping: a layer produces Inf/NaN (see the culprit)" with no culprit named."""
    scales, skipped, s = [], [], 2.0 ** 16
    for i in range(60):
        skip = 10 <= i < 40 and i % 3 == 0
        s = s / 2 if skip else s
        scales.append(s)
        skipped.append(int(skip))
    p = synthetic_trace(tmp_path / "t.sqlite", grad_exps=[(-4, 10)], scales=scales, skipped=skipped)
    rep = build_report(p)
    h = scaler_health(rep)
    assert (h.state, h.overflow_after_startup, h.last_skip_step, h.steps_after_last_skip) == ("settled", 10, 39, 20)
    text = "\n".join(rep.advice)
    assert "persistent" not in text and "see the culprit" not in text and "without the overflow stopping" not in text
    assert ("10 after start-up with a finite loss while the scale fell from 2**16 to 2**6, the last at step 39; "
            "none in the 20 steps after it") in text and "init_scale=64)" in text, text
    # the same skips going on to the end are persistent, as before, and name no culprit that is not there
    p = synthetic_trace(tmp_path / "p.sqlite", grad_exps=[(-4, 10)], scales=scales[:40], skipped=skipped[:40])
    rep = build_report(p)
    assert scaler_health(rep).state == "persistent"
    assert "see the culprit" not in "\n".join(rep.advice)


@pytest.mark.parametrize("detail,maker,fix", [
    ({"kind": "activation", "input_nonfinite": True}, "comes from the code that feeds lin, outside the watched layers",
     "Fix that code (above)"),
    ({"kind": "gradient", "from_loss": True}, "comes from the loss computation, outside the watched layers",
     "Compute the loss in FP32 (above)"),
    ({"kind": "activation"}, "comes from a layer that produces it (above)", "Fix that layer (above)"),
])
def test_a_collapsed_scale_names_what_made_the_nan(tmp_path, detail, maker, fix):
    """Every step skipped, the scale below 1: the advice said "the Inf/NaN comes from a layer that produces it
    ... Fix that layer (above)" when no layer made it (its input came in NaN, or the loss overflowed)."""
    from ampdoctor.trace import TraceWriter

    w = TraceWriter(tmp_path / "t.sqlite")
    w.set_meta(format="fp16", every=1, status="finished", argv=["synthetic"])
    w.add_layers([(0, "lin", "Linear", 0, 1, None)])
    for step in range(30):
        w.add_step((step, float("nan"), 2.0 ** (15 - step), 1, step + 1, 1, float(step)))
    w.add_event(0, "first_nonfinite", "lin", call=0, producers=0, **detail)
    w.commit()
    w.close()
    text = " ".join("\n".join(build_report(tmp_path / "t.sqlite").advice).split())
    assert "collapsed" in text and maker in text and fix in text, text
    if detail.get("input_nonfinite") or detail.get("from_loss"):
        assert "Fix that layer" not in text and "a layer that produces it" not in text, text


def test_a_second_models_root_is_named_as_the_whole_of_it_in_prose(tmp_path):
    """A second watched model's root is the layer ``Linear:``; the diagnosis and advice said "the input of
    Linear: was already non-finite", which reads as a cut-off name."""
    from ampdoctor.report.phrasing import shown_layer
    from ampdoctor.trace import TraceWriter

    assert (shown_layer(""), shown_layer(None), shown_layer("D:"), shown_layer("net.2")) == \
        ("(root)", "(root)", "D: (whole model)", "net.2")
    w = TraceWriter(tmp_path / "t.sqlite")
    w.set_meta(format="fp16", every=1, status="finished", argv=["synthetic"])
    w.add_layers([(0, "", "Linear", 0, 1, None), (1, "Linear:", "Linear", 1, 1, None)])
    for step in range(3):
        w.add_step((step, float("nan"), None, None, step + 1, 1, float(step)))
    w.add_event(0, "first_nonfinite", "Linear:", kind="activation", call=0, producers=0, input_nonfinite=True)
    w.commit()
    w.close()
    rep = build_report(tmp_path / "t.sqlite")
    text = " ".join("\n".join(rep.advice).split())
    assert "The input of Linear: (whole model) was already non-finite at step 0" in text, text


@pytest.mark.parametrize("collapse", [True, False])
def test_a_collapsed_scale_does_not_recommend_an_init_scale_as_a_fix(tmp_path, collapse):
    """Ten clean steps, then every step skipped while the scale halves to below 1: the advice said
    "changing init_scale will not help" and, beside it, "Loss scale: ... Recommended
    `torch.amp.GradScaler(init_scale=...)`" as if that were a fix. The range is qualified: what to use once
    the Inf/NaN is fixed. A healthy run's recommendation is not."""
    n = 30 if collapse else 10
    scales = [2.0 ** 16] * 10 + [2.0 ** (15 - i) for i in range(n - 10)]
    skipped = [0] * 10 + [1] * (n - 10)
    rep = build_report(synthetic_trace(tmp_path / "t.sqlite", grad_exps=[(-4, 10), (2, 5)], scales=scales,
                                       skipped=skipped))
    assert scaler_health(rep).state == ("collapse" if collapse else "healthy")
    text = " ".join("\n".join(rep.advice).split())
    assert "Recommended `torch.amp.GradScaler(init_scale=" in text, text
    assert ("once the Inf/NaN above is fixed (no loss scale fixes it)" in text) == collapse, text
    assert ("Loss scale: static" in text) != collapse, text


def test_fix_of_a_weightless_layer_of_a_pure_half_model_does_not_turn_autocast_off(tmp_path):
    """A layer with no weights (a gate ``x * x * 300``) in a pure ``.half()`` model: its plain-PyTorch fix said
    "in Gate.forward, run the body under `with torch.autocast(x.device.type, enabled=False):`" (there is no
    autocast), as did the HTML fix section. It says to compute on a float32 input and cast the result back."""
    import torch
    from torch import nn

    import ampdoctor
    from ampdoctor.report.html import render_html

    class Gate(nn.Module):
        def forward(self, x):
            return x * x * 300.0

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Gate(), nn.Linear(8, 1)).half()
    opt = torch.optim.SGD(model.parameters(), 1e-3)
    with ampdoctor.watch(model, trace=str(tmp_path / "t.sqlite")):
        for _ in range(3):
            loss = model(torch.randn(16, 8).half() * 30).float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = build_report(tmp_path / "t.sqlite")
    assert (report.diagnosis.first_nonfinite or {}).get("layer") == "1", report.diagnosis
    fix = next(a for a in report.advice if "keep_fp32(model[1])" in a)
    assert "autocast(" not in fix and "the model is float16 with no autocast to turn off" in fix, fix
    assert "in Gate.forward, begin with `dtype, x = x.dtype, x.float()` and return the result `.to(dtype)`" in fix, fix
    page = render_html(report)
    section = page[page.index('id="fix"'):]
    section = section[:section.index("</section>")]
    assert "enabled=False" not in section and "y = model[1](x.float()).to(x.dtype)" in section, section
