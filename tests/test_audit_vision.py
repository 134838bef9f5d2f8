"""Audit (vision): the recorder must not change the gradients it measures (channels_last
MobileNetV3-style blocks), and keep_fp32 handles that share a tensor restore it only when the
last one goes."""

import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor import keep_fp32
from ampdoctor.precision import force_fp32


class _SqueezeExcitation(nn.Module):
    def __init__(self, c: int, s: int):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(c, s, 1)
        self.relu = nn.ReLU(inplace=True)
        self.fc2 = nn.Conv2d(s, c, 1)
        self.hs = nn.Hardsigmoid(inplace=True)

    def forward(self, x):
        return self.hs(self.fc2(self.relu(self.fc1(self.avgpool(x))))) * x


class _InvertedResidual(nn.Module):
    """torchvision's MobileNetV3 block: expand, depthwise, squeeze-excitation, project, ``result += input``."""

    def __init__(self, c: int, e: int):
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv2d(c, e, 1, bias=False), nn.BatchNorm2d(e), nn.Hardswish(inplace=True),
            nn.Conv2d(e, e, 3, padding=1, groups=e, bias=False), nn.BatchNorm2d(e), nn.Hardswish(inplace=True),
            _SqueezeExcitation(e, e // 4), nn.Conv2d(e, c, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x):
        result = self.block(x)
        result += x
        return result


def _mobilenet_tail():
    """The blocks at the end of a MobileNetV3 on small images (1x1 spatial), in channels_last: where
    the residual's two gradients meet with strides that differ in their size-1 dimensions."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.Hardswish(inplace=True),
                      _InvertedResidual(16, 64), _InvertedResidual(16, 64), _InvertedResidual(16, 64),
                      nn.Conv2d(16, 64, 1), nn.Hardswish(inplace=True), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                      nn.Linear(64, 10))
    x = torch.randn(4, 3, 1, 1)
    return m.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's values as raw bytes in logical order: equal only if every bit is (-0.0 != 0.0, NaN == NaN)."""
    return t.detach().clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)


def _step(m, x, autocast: bool):
    for p in m.parameters():
        p.grad = None
    with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
        out = m(x)
    out.float().sum().backward()
    return out.detach().clone(), [(p.grad.clone(), p.grad.stride()) for p in m.parameters()]


def _hooks(m):
    return [(len(mod._forward_pre_hooks), len(mod._forward_hooks), len(mod._backward_hooks)) for mod in m.modules()]


@pytest.mark.parametrize("autocast", [True, False], ids=["fp16_autocast", "fp32"])
def test_watch_leaves_channels_last_gradients_bit_for_bit(tmp_path, autocast):
    """watch() held every gradient it was handed until the backward pass ended (to measure them in one
    batch). Autograd adds the residual's second gradient in place only into a gradient nobody else holds;
    held, it added out of place, into a tensor with the other addend's strides, and the layers before got
    different gradients (120 of mobilenet_v3_small's 142 in channels_last; the forward was identical)."""
    m, x = _mobilenet_tail()
    hooks = _hooks(m)
    ref_out, ref = _step(m, x, autocast)
    assert all(torch.isfinite(g).all() for g, _ in ref)
    m, x = _mobilenet_tail()
    with ampdoctor.watch(m, trace=str(tmp_path / "t.sqlite")):
        out, got = _step(m, x, autocast)
    assert _bits(out).equal(_bits(ref_out))
    differ = [i for i, ((a, sa), (b, sb)) in enumerate(zip(ref, got)) if sa != sb or not _bits(a).equal(_bits(b))]
    assert differ == [], f"{len(differ)} of {len(ref)} parameter gradients changed by watch()"
    assert _hooks(m) == hooks
    again_out, again = _step(m, x, autocast)  # (the BatchNorm running stats moved: compare with a fresh one)
    m2, x2 = _mobilenet_tail()
    _step(m2, x2, autocast)
    out2, ref2 = _step(m2, x2, autocast)
    assert _bits(again_out).equal(_bits(out2))
    assert all(sa == sb and _bits(a).equal(_bits(b)) for (a, sa), (b, sb) in zip(again, ref2))


def test_watch_leaves_a_leaf_inputs_gradient_strides(tmp_path):
    """A leaf tensor that a watched module takes as input (the script's ``x.requires_grad_()``, a parameter
    passed as an argument): autograd makes the incoming gradient its ``.grad`` when nobody else holds it,
    else a copy with the leaf's strides; watch() holding it changed ``x.grad.stride()``."""
    def run(watched: bool):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Conv2d(8, 8, 1), nn.ReLU()).to(memory_format=torch.channels_last)
        x = torch.randn(4, 8, 1, 1).contiguous(memory_format=torch.channels_last).requires_grad_()
        w = ampdoctor.watch(m, trace=str(tmp_path / "t.sqlite")) if watched else None
        try:
            m(x).sum().backward()
        finally:
            if w is not None:
                w.remove()
        return x.grad

    ref, got = run(False), run(True)
    assert got.stride() == ref.stride()
    assert _bits(got).equal(_bits(ref))


def test_watch_still_measures_the_gradients_it_copies(tmp_path):
    """The gradient rows come from the copies: their statistics are those of the gradients (numpy)."""
    import numpy as np

    from ampdoctor.trace import TraceReader

    torch.manual_seed(0)
    lin = nn.Linear(6, 5)
    m = nn.Sequential(lin)
    x = torch.randn(3, 6)
    seen = []
    with ampdoctor.watch(m, trace=str(tmp_path / "t.sqlite")):
        out = m(x)
        out.register_hook(lambda g: seen.append(g.detach().clone()))
        (out * torch.arange(5.0)).sum().backward()
        torch.optim.SGD(m.parameters(), lr=0.0).step()
    g = seen[0].numpy()
    r = TraceReader(tmp_path / "t.sqlite")
    names = {lay["id"]: lay["name"] for lay in r.layers()}
    rows = [row for row in r.stats(kind="gradient") if names[row["layer"]] == "0"]
    assert len(rows) == 1
    row = rows[0]
    assert row["numel"] == g.size == 15
    assert row["zero"] == int((g == 0).sum()) == 3
    assert row["min"] == float(g.min()) and row["max"] == float(g.max()) == 4.0
    assert row["absmax"] == float(np.abs(g).max())


# -- keep_fp32 handles sharing a tensor (a .half() model) ---------------------------------------

def _half_pair():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).half()


def test_overlapping_keep_fp32_restores_only_when_the_last_handle_goes():
    """keep_fp32(model) and keep_fp32(model[0]) share model[0]'s parameters: removing one put them back
    to half while the other still ran the module in FP32 (its forward then failed on the dtype mix, or
    ran in half); removed in the other order, the parameters stayed float32 for good."""
    for order in ("inner_first", "outer_first"):
        m = _half_pair()
        orig = [p.detach().clone() for p in m.parameters()]
        ids = [id(p) for p in m.parameters()]
        outer = keep_fp32(m)
        inner = keep_fp32(m[0])
        assert all(p.dtype == torch.float32 for p in m.parameters())
        first, second = (inner, outer) if order == "inner_first" else (outer, inner)
        first.remove()
        kept = m if second is outer else m[0]
        assert all(p.dtype == torch.float32 for p in kept.parameters()), order
        x = torch.randn(2, 4).half()
        assert m(x).dtype == torch.float16
        second.remove()
        assert [id(p) for p in m.parameters()] == ids
        assert all(p.dtype == torch.float16 for p in m.parameters()), order
        assert all(_bits(p).equal(_bits(o)) for p, o in zip(m.parameters(), orig)), order  # (float16 -> 32 -> 16: exact)


def test_the_same_module_kept_twice_and_tied_weights_are_refcounted():
    m = _half_pair()
    orig = _bits(m[0].weight).clone()
    a, b = keep_fp32(m[0]), keep_fp32(m[0])
    a.remove()
    assert m[0].weight.dtype == torch.float32  # b still runs it in FP32
    m(torch.randn(2, 4).half())
    a.remove()  # (a second remove of the same handle gives back nothing more)
    assert m[0].weight.dtype == torch.float32
    b.remove()
    assert m[0].weight.dtype == torch.float16 and _bits(m[0].weight).equal(orig)

    # two modules sharing one weight, both forced (force_fp32 upcasts a tie), each by its own handle
    m = _half_pair()
    m[1].weight = m[0].weight
    orig = _bits(m[0].weight).clone()
    g0 = force_fp32(m, ["0"])  # forces its partner "1" too
    g1 = force_fp32(m, ["1"])
    g0.remove()
    assert m[0].weight.dtype == torch.float32 and m[1].weight is m[0].weight
    m(torch.randn(2, 4).half())
    g1.remove()
    assert m[0].weight.dtype == torch.float16 and _bits(m[0].weight).equal(orig)
    assert m(torch.randn(2, 4).half()).dtype == torch.float16


def test_a_value_changed_while_forced_is_kept_on_restore():
    """What comes back is the tensor's value now, rounded to its dtype (training changed it while
    forced), not the value it had when the first handle upcast it."""
    m = _half_pair()
    a, b = keep_fp32(m[0]), keep_fp32(m)
    with torch.no_grad():
        m[0].weight.fill_(0.1)
    a.remove()
    b.remove()
    assert m[0].weight.dtype == torch.float16
    assert torch.equal(m[0].weight, torch.full((4, 4), 0.1, dtype=torch.float16))


def test_only_gradients_outside_the_default_layout_are_copied():
    """The copy is for layouts that holding a gradient can change (channels_last, permuted, other strides
    on size-1 dimensions); a row-major gradient (every gradient of a transformer) is measured where it is,
    with no copy, and an expanded one is never added into in place."""
    from ampdoctor.watch import _layout_may_change

    assert not _layout_may_change(torch.randn(4, 8))
    assert not _layout_may_change(torch.randn(4, 8, 1, 1))
    assert not _layout_may_change(torch.randn(1, 3))
    assert _layout_may_change(torch.randn(4, 8, 5, 5).contiguous(memory_format=torch.channels_last))
    assert _layout_may_change(torch.empty_strided((4, 8, 1, 1), (8, 1, 8, 8)))  # channels_last at 1x1
    assert _layout_may_change(torch.randn(4, 8).t())
    assert not _layout_may_change(torch.ones(()).expand(4, 8))
    calls = []
    orig = torch.Tensor.clone

    def counting(self, *a, **k):
        calls.append(self.shape)
        return orig(self, *a, **k)

    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(3, 8)
    with ampdoctor.watch(m):
        torch.Tensor.clone = counting
        try:
            (m(x) + m(x)).sum().backward()
        finally:
            torch.Tensor.clone = orig
    assert calls == []
