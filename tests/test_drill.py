"""Op drill-down: the first overflowing op and its source line, and a clean removal."""

from __future__ import annotations

import copy
import inspect
import linecache
import os
import sys
import types

import pytest
import torch
from helpers import SoftCube
from torch import nn

from ampdoctor.bisect.drill import OpProbe, drill_down
from ampdoctor.bisect.driver import _source_line
from ampdoctor.precision import keep_fp32

AC = dict(device_type="cpu", dtype=torch.float16)


class Attention(nn.Module):
    """q @ k^T without the 1/sqrt(d) scale: overflows fp16 for large activations."""

    def __init__(self, d: int):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)

    def forward(self, x):
        q, k = self.q(x), self.k(x)
        scores = q @ k.transpose(-2, -1)
        return torch.softmax(scores, -1)


class SquareNorm(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        h = self.proj(x)
        ms = (h * h).mean(-1, keepdim=True)
        return h / torch.sqrt(ms + 1e-6)


def line_of(obj, text: str) -> int:
    src, start = inspect.getsourcelines(obj)
    return start + next(i for i, line in enumerate(src) if text in line)


def _big(linear: nn.Linear, value: float) -> None:
    with torch.no_grad():
        linear.weight.zero_()
        linear.bias.fill_(value)


def _no_probe_left(model: nn.Module) -> None:
    assert not torch._C._is_torch_function_mode_enabled()
    assert torch.overrides._get_current_function_mode_stack() == []
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
        assert not m._forward_hooks_always_called


def test_attention_matmul_is_the_producer():
    model = nn.Sequential(nn.Linear(16, 16), Attention(16))
    _big(model[1].q, 100.0)
    _big(model[1].k, 100.0)  # 16 * 100 * 100 = 1.6e5 > 65504
    with OpProbe(model, ["1"]) as probe:
        probe.step = 7
        with torch.autocast(**AC):
            out = model(torch.randn(2, 4, 16))
        out.float().sum().backward()
    first = probe.first
    assert first.op == "matmul" and first.phase == "forward"
    assert first.layer == "1" and first.nonfinite and first.step == 7
    assert first.where == f"{os.path.basename(__file__)}:{line_of(Attention.forward, 'q @ k')}"
    assert first.path == __file__
    assert first.overflow_count == 2 * 4 * 4 and first.dtype == "float16"
    assert first.absmax_fp32 == pytest.approx(16 * 100.0 * 100.0)
    assert probe.worst.op == "matmul"
    # The softmax of inf is NaN but it is not a producer: its input was already non-finite.
    assert not any(f.op == "softmax" and f.phase == "forward" for f in probe.findings)
    assert any(f.phase == "backward" and f.op == "matmul" for f in probe.findings)
    _no_probe_left(model)


def test_norm_square_is_mul():
    model = nn.Sequential(SquareNorm(8))
    _big(model[0].proj, 300.0)  # 300 * 300 = 9e4 > 65504
    with torch.autocast(**AC):
        findings = drill_down(model, ["0"], lambda: model(torch.randn(3, 8)))
    first = findings[0]
    assert first.op == "mul" and first.nonfinite
    assert first.where.endswith(f":{line_of(SquareNorm.forward, 'h * h')}")
    _no_probe_left(model)


def test_fp32_values_beyond_fp16_max_are_overflow():
    model = nn.Sequential(SquareNorm(8))
    _big(model[0].proj, 300.0)
    with OpProbe(model, ["0"], fmt="fp16") as probe:
        model(torch.randn(3, 8))  # fp32 run: finite, but 9e4 would be inf in fp16
    first = probe.first
    assert first.op == "mul" and not first.nonfinite
    assert first.overflow_count == 3 * 8 and first.absmax == pytest.approx(9e4)
    with OpProbe(model, ["0"], fmt="bf16") as probe:
        model(torch.randn(3, 8))
    assert probe.findings == []  # bf16 has fp32's range


class TransposeFirst(nn.Module):
    """nn.MultiheadAttention(batch_first=True) style: transposes its input before projecting it."""

    def __init__(self, d: int):
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        h = x.transpose(0, 1).contiguous()
        return self.proj(h)


def test_an_op_that_passes_on_a_too_large_input_is_not_the_first():
    # the fp32 input is already beyond fp16's max when it comes in: the transposes pass it on
    # (overflow findings, marked passthrough); the linear, whose fp16 output under autocast is Inf
    # from finite inputs, is where it breaks
    model = nn.Sequential(TransposeFirst(8))
    x = torch.full((2, 3, 8), 1e5)
    with OpProbe(model, ["0"]) as probe:
        with torch.autocast(**AC):
            model(x)
    ops = [(f.op, f.passthrough) for f in probe.findings if f.phase == "forward"]
    assert ops[:2] == [("transpose", True), ("contiguous", True)]
    assert probe.first.op == "linear" and probe.first.nonfinite and not probe.first.passthrough
    # nothing but pass-throughs (an fp32 run): the first of them is still named
    with OpProbe(model, ["0"]) as probe:
        model(x)
    assert all(f.passthrough for f in probe.findings if f.phase == "forward")
    assert probe.first.op == "transpose"
    _no_probe_left(model)


class MaskedAttention(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])  # 0 and -inf
        return self.attn(x, x, x, attn_mask=mask, need_weights=False)[0]


def test_an_additive_mask_of_minus_inf_does_not_hide_the_producer():
    # nn.MultiheadAttention with a causal mask of -inf, on an input beyond fp16's max: its output is
    # NaN/Inf although its only non-finite input is the mask, so it is the producer (the transposes
    # before it pass the input on)
    torch.manual_seed(0)
    model = nn.Sequential(MaskedAttention(8))
    with OpProbe(model, ["0"]) as probe:
        with torch.autocast(**AC):
            model(torch.randn(2, 5, 8) * 3e4)
    first = probe.first
    assert first.op == "multi_head_attention_forward" and first.nonfinite and first.phase == "forward"
    assert first.where.endswith(f":{line_of(MaskedAttention.forward, 'self.attn(')}")
    _no_probe_left(model)


def test_only_inside_probed_modules_and_not_ampdoctor_ops():
    model = nn.Sequential(SquareNorm(8), SquareNorm(8))
    _big(model[0].proj, 300.0)
    _big(model[1].proj, 300.0)
    # keep_fp32's input casts are ampdoctor's ops: never recorded.
    with keep_fp32(model[1].proj), OpProbe(model, ["1"]) as probe:
        with torch.autocast(**AC):
            model(torch.randn(3, 8))
    layers = {f.layer for f in probe.findings}
    assert layers == {"1"}
    # linear, mul, mean, add, sqrt, truediv: keep_fp32's input cast (ampdoctor code) is not an op here.
    assert probe.ops_seen == 6
    assert probe.first.op == "mul" and probe.first.dtype == "float32" and not probe.first.nonfinite


def test_nested_probed_modules_share_one_mode():
    model = nn.Sequential(SquareNorm(8))
    _big(model[0].proj, 300.0)
    with torch.autocast(**AC), OpProbe(model, ["0", "0.proj"]) as probe:
        model(torch.randn(2, 8))
        assert not torch._C._is_torch_function_mode_enabled()
    assert probe.first.layer == "0" and probe.first.op == "mul"
    _no_probe_left(model)


def test_forward_raising_leaves_no_mode():
    class Boom(nn.Module):
        def forward(self, x):
            x = x * 2  # an op recorded while the mode is active
            raise RuntimeError(f"boom {x.shape}")

    model = nn.Sequential(Boom())
    with OpProbe(model, ["0"]):
        with pytest.raises(RuntimeError, match="boom"):
            model(torch.ones(2))
        assert not torch._C._is_torch_function_mode_enabled()
    _no_probe_left(model)


def test_deepcopy_while_probing():
    model = nn.Sequential(SquareNorm(8))
    with OpProbe(model, ["0"]) as probe:
        twin = copy.deepcopy(model)
        twin(torch.randn(2, 8))
        assert not torch._C._is_torch_function_mode_enabled()
    assert probe.ops_seen == 6  # the copy is probed too while the probe is open
    twin(torch.randn(2, 8))
    assert probe.ops_seen == 6 and not torch._C._is_torch_function_mode_enabled()


def test_unknown_module_name():
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="OpProbe: Sequential has no module named '1'"):
        OpProbe(model, ["1"])


class _CellCompiler:
    """IPython's ``CachingCompiler`` contract (IPython >= 8): ``format_code_name`` labels the cells it compiled."""

    def __init__(self):
        self._filename_map = {}

    def cache(self, source: str, number: int) -> str:
        name = f"/tmp/ipykernel_4242/{abs(hash(source))}.py"  # ipykernel names a cell's file so
        self._filename_map[name] = number
        linecache.cache[name] = (len(source), None, source.splitlines(True), name)  # as IPython keeps its code
        return name

    def format_code_name(self, name: str):
        if name in self._filename_map:
            return "Cell", f"In[{self._filename_map[name]}]"
        return None


CELL = '''\
class CellNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        h = self.proj(x)
        return h * h
'''


@pytest.mark.parametrize("compiler", ["stand-in", "IPython"])
def test_notebook_cell_location_is_the_cell_plain_files_unchanged(monkeypatch, compiler):
    # In Jupyter the op's file is the cell's temporary file (/tmp/ipykernel_1234/3456.py): name the cell
    if compiler == "IPython":
        compiler = pytest.importorskip("IPython.core.compilerop").CachingCompiler()
    else:
        compiler = _CellCompiler()
    name = compiler.cache(CELL, number=5)
    ns = {"nn": nn}
    exec(compile(CELL, name, "exec"), ns)
    shell = types.SimpleNamespace(compile=compiler)
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: shell))
    model = nn.Sequential(SquareNorm(8), ns["CellNorm"](8))  # SquareNorm's output stays finite (h / inf = 0)
    _big(model[0].proj, 300.0)  # 300 * 300 = 9e4 > 65504
    _big(model[1].proj, 300.0)
    with torch.autocast(**AC), OpProbe(model, ["0", "1"]) as probe:
        model(torch.randn(3, 8))
    producers = [f for f in probe.findings if f.phase == "forward" and f.nonfinite]
    assert [(f.layer, f.op, f.where) for f in producers] == [
        ("0", "mul", f"{os.path.basename(__file__)}:{line_of(SquareNorm.forward, 'h * h')}"),
        ("1", "mul", "cell In[5], line 8")]
    assert producers[1].path == name
    # bisect's ops entries quote the line: a cell's too (it got none)
    assert _source_line(producers[1].path, producers[1].where) == "return h * h"
    # outside IPython (no shell running) a cell file is a file like any other
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: None))
    with torch.autocast(**AC), OpProbe(model, ["1"]) as probe:
        model(torch.randn(3, 8))
    assert probe.first.where == f"{os.path.basename(name)}:8"


def test_a_gradient_that_came_in_nonfinite_is_not_made_by_the_layer():
    """The backward of code outside the probed layer (a custom autograd Function in its parent) makes
    the Inf: the gradient of the layer's output arrives non-finite. Its op is marked as passing it on
    (the bisect summary and JSON say it came in), where it was reported as the layer's own."""

    class Amp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g * 1e7  # beyond fp16's max

    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return Amp.apply(self.fc(x))

    torch.manual_seed(0)
    model = Gate()
    with OpProbe(model, ["fc"]) as probe:
        with torch.autocast(**AC):
            out = model(torch.randn(4, 8))
        (out.float().sum() * 100).backward()
    bwd = [f for f in probe.findings if f.phase == "backward"]
    assert bwd and all(f.nonfinite and f.passthrough for f in bwd), probe.findings
    assert probe.first is bwd[0]  # (nothing else to name; the bisect summary says it came in)


def test_the_probe_keeps_the_first_step_an_input_came_in_too_large():
    """The bisect cause line gave the step of the largest input only (step 14 where it began at 10)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    with OpProbe(model, ["0"]) as probe:
        for step, scale in enumerate((1.0, 1e5, 3e5, 2e5)):
            probe.step = step
            with torch.no_grad():
                model(torch.full((2, 4), scale))
    assert probe.inputs_first == {"0": 1}
    assert probe.inputs_beyond["0"] == (3e5, 2)


class MinMaskedAttention(Attention):
    """q @ k^T plus a causal mask of the dtype's most negative finite value, as HF transformers' eager
    attention builds it (``torch.finfo(dtype).min`` where a position is masked)."""

    def forward(self, x):
        q, k = self.q(x), self.k(x)
        scores = q @ k.transpose(-2, -1)
        n = scores.shape[-1]
        mask = torch.full((n, n), torch.finfo(scores.dtype).min, dtype=scores.dtype, device=scores.device).triu(1)
        scores = scores + mask
        return torch.softmax(scores.float(), -1)


def test_the_worst_op_is_not_the_add_of_a_finfo_min_mask():
    """The add of a finfo.min mask has the largest output (about 65504 in fp16, by construction) of every
    op in the layer: it was named the worst op of every HF eager attention; the op whose own output is
    largest is the matmul."""
    torch.manual_seed(0)
    model = nn.Sequential(MinMaskedAttention(16))
    _big(model[0].q, 10.0)
    _big(model[0].k, 10.0)  # scores 16 * 10 * 10 = 1600: no overflow
    with OpProbe(model, ["0"]) as probe:
        with torch.autocast(**AC):
            model(torch.randn(2, 4, 16))
    assert probe.worst is not None and probe.worst.op == "matmul", probe.worst
    assert probe.worst.absmax == pytest.approx(1600.0)
    _no_probe_left(model)


class _Cube(nn.Module):
    def forward(self, x):
        return SoftCube.apply(x)


class _Raising(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        g = g * 2  # an op recorded while the mode is on
        raise RuntimeError(f"boom {g.shape}")


def test_ops_inside_a_custom_backward_are_named_at_their_line():
    """A custom autograd Function whose backward overflows fp16 (its forward is in range): no op hook saw
    its backward, so the drill-down named the forward's ``pow`` (abs-max 16.7, no overflow) as the worst op
    and no line of the backward. Now the backward's own ops are recorded, as phase "backward", at their
    lines."""
    model = nn.Sequential(nn.Linear(4, 8), _Cube())
    with torch.no_grad():
        model[0].weight.fill_(0.0)
        model[0].bias.fill_(200.0)
    with OpProbe(model, ["1"]) as probe:
        with torch.autocast(**AC):
            out = model(torch.randn(2, 4))
        out.float().sum().backward()
        assert not torch._C._is_torch_function_mode_enabled()
    line = next(i for i, t in enumerate(inspect.getsource(sys.modules[SoftCube.__module__]).splitlines(), 1)
                if "# BACKWARD LINE" in t)
    first = probe.first
    assert (first.layer, first.op, first.phase, first.where) == ("1", "mul", "backward", f"helpers.py:{line}"), \
        probe.findings
    assert first.nonfinite and not first.passthrough
    assert not [f for f in probe.findings if f.phase == "forward"], probe.findings
    _no_probe_left(model)


def test_a_custom_backward_that_raises_leaves_no_mode():
    class M(nn.Module):
        def forward(self, x):
            return _Raising.apply(x) * 1.0

    model = nn.Sequential(M())
    x = torch.ones(2, requires_grad=True)
    with OpProbe(model, ["0"]) as probe:
        out = model(x)
        with pytest.raises(RuntimeError, match="boom"):
            out.sum().backward()
        assert not torch._C._is_torch_function_mode_enabled()
        model(x * 3e5)  # the probe still records the next forward's ops, as forward
        assert probe.findings and {(f.op, f.phase) for f in probe.findings} == {("mul", "forward")}, probe.findings
    assert not torch._C._is_torch_function_mode_enabled()
    _no_probe_left(model)
