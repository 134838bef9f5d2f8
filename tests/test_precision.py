"""keep_fp32 / force_fp32: forcing under autocast and in pure half models, exact restore."""

from __future__ import annotations

import copy
import gc
import io
import types

import pytest
import torch
from torch import nn

from ampdoctor.precision import force_fp32, keep_fp32

AC = dict(device_type="cpu", dtype=torch.float16)


def _hook_state(m: nn.Module) -> tuple:
    return (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._forward_hooks_with_kwargs),
            len(m._forward_pre_hooks_with_kwargs), len(m._forward_hooks_always_called))


class Recorder(nn.Module):
    """Wraps a Linear and records what reached its forward."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.seen: list = []

    def forward(self, x, *rest, scale=None, extra=None):
        self.seen.append({
            "x": x.dtype, "rest": [t.dtype for t in rest if isinstance(t, torch.Tensor)],
            "scale": None if scale is None else scale.dtype,
            "extra": None if extra is None else {k: v.dtype for k, v in extra.items()},
            "autocast": torch.is_autocast_enabled("cpu"),
        })
        out = self.lin(x)
        if scale is not None:
            out = out * scale
        return out


def test_forced_linear_runs_fp32_under_autocast():
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8).half()
    with torch.autocast(**AC):
        assert lin(x).dtype == torch.float16
        with keep_fp32(lin):
            out = lin(x)
            assert torch.is_autocast_enabled("cpu")  # restored after the forward
        assert out.dtype == torch.float32
        assert lin(x).dtype == torch.float16
    ref = torch.nn.functional.linear(x.float(), lin.weight, lin.bias)
    torch.testing.assert_close(out, ref)


def test_inputs_cast_args_kwargs_nested():
    m = Recorder()
    x = torch.randn(2, 8).half()
    with torch.autocast(**AC), keep_fp32(m):
        out = m(x, torch.ones(1).half(), torch.arange(3), scale=torch.tensor(2.0).half(),
                extra={"a": torch.ones(2).bfloat16(), "b": torch.ones(2, dtype=torch.float64)})
    seen = m.seen[-1]
    assert seen["x"] == torch.float32 and seen["rest"] == [torch.float32, torch.int64]
    assert seen["scale"] == torch.float32
    assert seen["extra"] == {"a": torch.float32, "b": torch.float64}  # never lowers precision
    assert seen["autocast"] is False
    assert out.dtype == torch.float32


def test_nested_tuple_and_list_inputs():
    class Pair(nn.Module):
        def forward(self, pair, items):
            return pair[0] + pair[1] + items[0]["t"]

    m = Pair()
    h = torch.ones(3).half()
    with keep_fp32(m):
        out = m((h, h), [{"t": h}])
    # No autocast: inputs were half, so the output is cast back to half (pure half model).
    assert out.dtype == torch.float16


def test_remove_restores_exactly():
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    keys = set(vars(lin))
    params = [id(p) for p in lin.parameters()]
    with torch.autocast(**AC):
        before = lin(x)
    h = keep_fp32(lin)
    with torch.autocast(**AC):
        assert lin(x).dtype == torch.float32
    h.remove()
    h.remove()  # idempotent
    assert not h.active
    with torch.autocast(**AC):
        after = lin(x)
    assert after.dtype == before.dtype == torch.float16
    assert torch.equal(before, after)
    assert _hook_state(lin) == (0, 0, 0, 0, 0)
    assert set(vars(lin)) == keys
    assert [id(p) for p in lin.parameters()] == params


def test_other_hooks_keep_working():
    lin = nn.Linear(8, 8)
    calls: list[str] = []
    lin.register_forward_pre_hook(lambda m, a: calls.append(f"pre:{a[0].dtype}"))
    lin.register_forward_hook(lambda m, a, o: calls.append(f"post:{o.dtype}"))
    with torch.autocast(**AC), keep_fp32(lin):
        lin(torch.randn(2, 8).half())
    assert calls == ["pre:torch.float32", "post:torch.float32"]
    assert _hook_state(lin)[:2] == (1, 1)


def test_pure_half_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4)).half()
    x = torch.randn(3, 8).half()
    before = model(x)
    weight = model[2].weight
    h = keep_fp32(model[2])
    assert model[2].weight is weight and weight.dtype == torch.float32
    assert model[2].bias.dtype == torch.float32
    seen = []
    model[2].register_forward_hook(lambda m, a, o: seen.append(o.dtype))
    out = model(x)
    assert seen == [torch.float16]  # cast back before the rest of the model sees it
    assert out.dtype == torch.float16
    out.float().sum().backward()
    assert weight.grad.dtype == torch.float32
    h.remove()
    assert model[2].weight is weight and weight.dtype == torch.float16
    assert weight.grad.dtype == torch.float16
    model.zero_grad(set_to_none=True)
    assert torch.equal(model(x), before)


def test_pure_half_buffers():
    bn = nn.BatchNorm1d(4).half()
    with keep_fp32(bn):
        assert bn.running_mean.dtype == torch.float32
        assert bn.num_batches_tracked.dtype == torch.int64
        assert bn(torch.randn(5, 4).half()).dtype == torch.float16
    assert bn.running_mean.dtype == torch.float16


def test_reused_and_nested_modules():
    lin = nn.Linear(8, 8)
    outer = nn.Sequential(lin, nn.ReLU(), lin)
    with torch.autocast(**AC):
        with keep_fp32(lin):
            y = lin(lin(torch.randn(2, 8)))
            assert y.dtype == torch.float32
            assert torch.is_autocast_enabled("cpu")
        with keep_fp32(outer), keep_fp32(lin):
            assert outer(torch.randn(2, 8)).dtype == torch.float32
            assert torch.is_autocast_enabled("cpu")
        assert outer(torch.randn(2, 8)).dtype == torch.float16
    assert _hook_state(lin) == (0, 0, 0, 0, 0) and _hook_state(outer) == (0, 0, 0, 0, 0)


def test_forward_raising_restores_autocast():
    class Boom(nn.Module):
        def forward(self, x):
            assert not torch.is_autocast_enabled("cpu")
            raise RuntimeError("boom")

    m = Boom()
    with torch.autocast(**AC):
        with keep_fp32(m):
            for _ in range(2):
                with pytest.raises(RuntimeError, match="boom"):
                    m(torch.ones(2))
                assert torch.is_autocast_enabled("cpu")
                assert torch.get_autocast_dtype("cpu") == torch.float16
        assert torch.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled("cpu")


def test_overflowing_linear_fixed_by_keep_fp32():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.big = nn.Linear(16, 4, bias=False)
            self.head = nn.Linear(4, 1)

        def forward(self, x):
            return self.head(self.big(x) / 1000.0)  # the scale-down comes too late in fp16

    model = Net()
    with torch.no_grad():
        model.big.weight.fill_(100.0)
    # |big(x)| = 16 * 100 * 100 = 1.6e5 > 65504 (fp16 max): inf under autocast.
    x = torch.full((2, 16), 100.0)
    with torch.autocast(**AC):
        assert not torch.isfinite(model(x)).all()
        with keep_fp32(model.big):
            out = model(x)
    assert out.dtype == torch.float16
    assert torch.isfinite(out).all()


def test_force_fp32_by_name_and_errors():
    model = nn.Sequential()
    model.add_module("enc", nn.Sequential(nn.Linear(8, 8), nn.ReLU()))
    model.add_module("head", nn.Linear(8, 2))
    x = torch.randn(2, 8)
    with torch.autocast(**AC):
        with force_fp32(model, ["enc.0", "head", "head"]) as g:
            assert model(x).dtype == torch.float32
            assert model.enc[0].weight.dtype == torch.float32
        assert not g.active
        assert model(x).dtype == torch.float16
    for m in model.modules():
        assert _hook_state(m) == (0, 0, 0, 0, 0)
    with pytest.raises(ValueError, match=r"no module named 'enc.O'; close matches: .*'enc.0'") as info:
        force_fp32(model, ["enc.0", "enc.O"])
    assert "named_modules" in str(info.value)
    assert _hook_state(model.enc[0]) == (0, 0, 0, 0, 0)  # validated before anything changed


def test_keep_fp32_rejects_non_module():
    with pytest.raises(TypeError, match="nn.Module"):
        keep_fp32(torch.ones(2))  # type: ignore[arg-type]


def test_model_copies_and_saves_while_forced():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    x = torch.randn(2, 4)
    with keep_fp32(model[1]) as h:
        twin = copy.deepcopy(model)  # e.g. an EMA copy made after the fix
        buf = io.BytesIO()
        torch.save(model, buf)
        with torch.autocast(**AC):
            assert twin(x).dtype == torch.float32
    assert h.module is model[1]
    with torch.autocast(**AC):
        assert model(x).dtype == torch.float16


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cls", [nn.Embedding, nn.EmbeddingBag])
def test_pure_half_embedding_output_cast_back(cls, dtype):
    """An embedding's inputs are integer indices: its FP32 output was not cast back, and the
    next layer of the pure half model failed (mat1 and mat2 must have the same dtype)."""
    torch.manual_seed(0)
    model = nn.Sequential(cls(10, 8), nn.Linear(8, 4)).to(dtype)
    idx = torch.tensor([[1, 2, 3]])
    before = model(idx)
    with keep_fp32(model[0]):
        assert model[0].weight.dtype == torch.float32
        out = model(idx)
        assert out.dtype == dtype
        out.float().sum().backward()
        assert model[0].weight.grad.dtype == torch.float32
    assert model[0].weight.dtype == dtype
    model.zero_grad(set_to_none=True)
    assert torch.equal(model(idx), before)


def test_pure_half_dataclass_output_cast_back():
    """A module returning a dataclass (frozen or not): its FP32 fields were not cast back, and
    the next layer of the pure half model failed."""
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Out:
        h: torch.Tensor
        n: int = 3

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return Out(self.lin(x))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Block(), nn.Linear(4, 4)

        def forward(self, x):
            return self.b(self.a(x).h)

    model = Model().half()
    x = torch.randn(2, 4).half()
    with keep_fp32(model.a):
        out = model.a(x)
        assert type(out) is Out and out.h.dtype == torch.float16 and out.n == 3
        assert model(x).dtype == torch.float16


@pytest.mark.parametrize("cast", ["double", "bfloat16"])
def test_remove_after_the_model_was_cast_again(cast):
    """keep_fp32 on a .half() model, then model.double() (or .bfloat16()): remove() put the module
    back to float16 while the rest of the model was float64/bfloat16, and the next forward failed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).half()
    h = keep_fp32(model[0])
    model(torch.randn(2, 4).half())
    getattr(model, cast)()
    dtype = model[1].weight.dtype
    x = torch.randn(2, 4, dtype=dtype)
    model(x)  # (bf16: the forcing pre-hook upcasts model[0] again)
    h.remove()
    assert model[0].weight.dtype == dtype and model[0].bias.dtype == dtype
    assert model(x).dtype == dtype


def test_autocast_entered_inside_a_forced_forward_stays_off():
    """HF ``Trainer(fp16=True)`` trains through accelerate, which replaces ``model.forward`` with one
    wrapped in ``torch.autocast``: entered after the forcing pre-hook, inside the forward, it must not
    turn autocast back on for what the forced module runs (it did: bisect's all-FP32 control ran in
    fp16 and the verdict was not_precision). Outside forced modules autocast is untouched, and after
    ``remove()`` ``autocast.__enter__`` is torch's own again."""
    from ampdoctor.precision import _Fp32Region
    gc.collect()
    original = torch.amp.autocast_mode.autocast.__enter__
    held = _Fp32Region.handles
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    seen: list = []
    for m in model:
        m.register_forward_hook(lambda mod, i, o: seen.append(o.dtype))
    wrapper = torch.autocast(**AC)  # one instance, entered at every call, as accelerate's decorator is
    model.forward = types.MethodType(wrapper(type(model).forward), model)

    class Inner(nn.Module):  # a module that enters autocast in its own forward
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            with torch.autocast(**AC):
                return self.lin(x)

    inner = Inner()
    x = torch.randn(2, 4)
    model(x)
    assert seen == [torch.float16] * 2 and inner(x).dtype == torch.float16
    h, hi = keep_fp32(model), keep_fp32(inner)
    seen.clear()
    assert model(x).dtype == torch.float32 and seen == [torch.float32] * 2
    assert inner(x).dtype == torch.float32
    with torch.autocast(**AC):  # not inside a forced module: autocast as before
        assert (x @ x.T).dtype == torch.float16
        assert model[0](x).dtype == torch.float16
    assert wrapper(nn.functional.linear)(x, model[0].weight).dtype == torch.float16  # the wrapper still enables
    h.remove()
    hi.remove()
    seen.clear()
    model(x)
    assert seen == [torch.float16] * 2 and inner(x).dtype == torch.float16
    gc.collect()
    assert _Fp32Region.handles == held
    if held == 0:
        assert torch.amp.autocast_mode.autocast.__enter__ is original


def test_autocast_guard_goes_with_the_last_handle_and_with_garbage_copies():
    from ampdoctor.precision import _Fp32Region
    gc.collect()
    held = _Fp32Region.handles
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    h = keep_fp32(model[1])
    twin = copy.deepcopy(model)  # its copy of the handle forces twin[1] and holds the guard too
    assert _Fp32Region.handles == held + 2
    h.remove()
    assert _Fp32Region.handles == held + 1
    with torch.autocast(**AC):
        assert twin(torch.randn(2, 4)).dtype == torch.float32
    del twin
    gc.collect()
    assert _Fp32Region.handles == held


def test_force_fp32_of_one_tied_module_forces_its_partner_in_a_half_model():
    """A pure .half() model with tied input/output embeddings (GPT-2's wte/lm_head): forcing one of
    them made the shared weight float32 for both, and the other's forward failed on the dtype (an HF
    audit's bisect errored on 99 of 148 trials). The module owning the other end of the tie is forced too."""
    from ampdoctor.precision import force_fp32

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(16, 8)
            self.mid = nn.Linear(8, 8)
            self.lm_head = nn.Linear(8, 16, bias=False)
            self.lm_head.weight = self.wte.weight

        def forward(self, ids):
            return self.lm_head(torch.relu(self.mid(self.wte(ids))))

    ids = torch.randint(0, 16, (2, 5))
    for name in ("lm_head", "wte"):
        m = Tied().half()
        with force_fp32(m, [name]) as g:
            out = m(ids)
            out.float().sum().backward()
            assert sorted(g.names) == ["lm_head", "wte"]
            assert out.dtype == torch.float16 and m.mid.weight.dtype == torch.float16
        assert m.wte.weight.dtype == torch.float16 and m.wte.weight is m.lm_head.weight
    m = Tied().half()  # an untied module forces nothing more
    with force_fp32(m, ["mid"]) as g:
        assert g.names == ["mid"] and m.wte.weight.dtype == torch.float16


class _TiedLM(nn.Module):
    """GPT-2 style: the output head's weight is the input embedding's (``lm_head.weight = wte.weight``)."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(16, 8)
        self.mid = nn.Linear(8, 8)
        self.lm_head = nn.Linear(8, 16, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids):
        return self.lm_head(torch.relu(self.mid(self.wte(ids))))


class _LinearDtypes(torch.overrides.TorchFunctionMode):
    """The dtypes of (input, weight) of every F.linear call."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[torch.dtype, torch.dtype]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.linear:
            self.seen.append((args[0].dtype, args[1].dtype))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_keep_fp32_of_a_tied_head_in_a_half_model_keeps_the_tie(dtype):
    """keep_fp32(model.lm_head) on a pure .half() model whose head is tied to the embedding (the report's
    advice for GPT-2): the shared weight was made float32 for the embedding too, whose fp32 output then
    met mid's half weight (a dtype error). Now the head computes from an FP32 copy of the shared weight,
    which stays one half Parameter, tied; its gradient comes back through the cast."""
    torch.manual_seed(0)
    m = _TiedLM().to(dtype)
    w = m.wte.weight
    before = (w.detach().clone(), {k: v.dtype for k, v in m.state_dict().items()})
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    ids = torch.randint(0, 16, (2, 5))
    h = keep_fp32(m.lm_head)
    assert m.lm_head.weight is w and w.dtype == dtype
    mode = _LinearDtypes()
    with mode:
        out = m(ids)
    assert out.dtype == dtype  # the rest of the model sees what it saw before
    assert mode.seen == [(dtype, dtype), (torch.float32, torch.float32)]  # mid in half, the head in FP32
    out.float().pow(2).mean().backward()
    assert w.grad is not None and w.grad.dtype == dtype and torch.isfinite(w.grad).all()
    opt.step()
    assert m.lm_head.weight is m.wte.weight is w and w.dtype == dtype and not torch.equal(w.detach(), before[0])
    assert isinstance(m.lm_head._parameters["weight"], nn.Parameter)  # the copy was only there during the call
    # the head's output in FP32 is the FP32 matmul of a half model's activations, cast back
    with torch.no_grad():
        x = torch.relu(m.mid(m.wte(ids)))
        assert torch.equal(m(ids), (x.float() @ w.float().t()).to(dtype))
    h.remove()
    h.remove()
    assert _hook_state(m.lm_head) == (0, 0, 0, 0, 0)
    assert m.lm_head.weight is m.wte.weight is w and {k: v.dtype for k, v in m.state_dict().items()} == before[1]
    with _LinearDtypes() as mode:
        m(ids)
    assert mode.seen == [(dtype, dtype)] * 2


def test_keep_fp32_of_a_tied_embedding_and_of_both_ends():
    """The other end (the embedding, whose input is indices): its output goes back to the weight's dtype.
    Both ends kept, each by its own keep_fp32: still one half Parameter, both compute in FP32."""
    torch.manual_seed(0)
    ids = torch.randint(0, 16, (2, 5))
    m = _TiedLM().half()
    with keep_fp32(m.wte):
        out = m(ids)
        assert out.dtype == torch.float16 and m.wte.weight.dtype == torch.float16
        out.float().sum().backward()
    assert m.wte.weight.grad.dtype == torch.float16 and m.lm_head.weight is m.wte.weight
    m = _TiedLM().half()
    with keep_fp32(m.wte), keep_fp32(m.lm_head), _LinearDtypes() as mode:
        assert m(ids).dtype == torch.float16
    assert mode.seen == [(torch.float16, torch.float16), (torch.float32, torch.float32)]
    assert m.wte.weight.dtype == torch.float16 and m.lm_head.weight is m.wte.weight
    # the whole model kept: the tie is inside it, so its parameters become FP32 as in any untied module
    m = _TiedLM().half()
    with keep_fp32(m):
        assert m.wte.weight.dtype == torch.float32 and m.lm_head.weight is m.wte.weight
        assert m(ids).dtype == torch.float16  # (no floating input: back to the parameters' dtype before)
    assert m.wte.weight.dtype == torch.float16


def test_keep_fp32_under_torch_compile_does_not_recompile_every_step():
    # the hooks' per-call state (autocast contexts on a stack) was traced and guarded on: a compiled model
    # with a kept module recompiled at every step until dynamo's recompile limit (an audit: 9 in 30 steps)
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 1))
    h = keep_fp32(model[2])
    cm = torch.compile(model, backend="aot_eager")
    frames = []
    for _ in range(12):
        with torch.autocast("cpu", dtype=torch.float16):
            out = cm(torch.randn(8, 16))
        out.float().sum().backward()
        frames.append(counters["frames"]["total"])
    assert frames[5] == frames[-1], frames  # nothing compiled after the first steps
    assert model[2].weight.dtype == torch.float32
    h.remove()
    torch._dynamo.reset()
