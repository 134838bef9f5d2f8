"""The CUDA statistics kernel (ampdoctor/_stats_cuda_kernel.cu) compiled for the CPU with a C++
compiler and the stand-ins of tests/emu/cuda_emu.h (one thread per block), against the torch
path: the kernel's classification, fast path, slow path and chunk folding give the same rows,
for every input dtype it serves and every format. The GPU run itself is checked by
tests/test_stats_cuda.py (marked cuda)."""

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from ampdoctor import _stats_nvrtc, stats
from ampdoctor.formats import FORMATS

EMU = Path(__file__).parent / "emu"
CXX = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
pytestmark = pytest.mark.skipif(CXX is None, reason="needs a C++ compiler")
CLEN = 1024  # short chunks: several per tensor, so stage 2 folds them


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    out = tmp_path_factory.mktemp("emu")
    built: dict = {}

    def get(dtype, fmt):
        key = (dtype, fmt.name)
        if key not in built:
            src = out / f"k_{len(built)}.cu"
            src.write_text(_stats_nvrtc.source(_stats_nvrtc.defines(dtype, fmt)))
            exe = out / f"k_{len(built)}"
            subprocess.run([CXX, "-O1", "-std=c++17", f"-I{EMU}", f'-DKERNEL_SOURCE="{src}"', "-x", "c++",
                            str(EMU / "driver.cpp"), "-o", str(exe)], check=True, capture_output=True)
            built[key] = exe
        return built[key]

    return get, out


def _values(dtype, n, seed, special: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-160, 140, (n,), generator=g).to(torch.float64))
    x = x.clamp(-3.4e38, 3.4e38)
    if not special:  # the fast path: finite only (zeros and tiny values included)
        x[::7] = 0.0
        x = x.to(dtype)
        return x.masked_fill(~torch.isfinite(x), 1.0)
    x = x.to(dtype)
    fi = torch.finfo(dtype)
    sp = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, fi.max, -fi.max, fi.tiny,
                       fi.tiny * fi.eps, 65504.0, 65520.0, 65536.0, -70000.0, 2.0 ** -24, 2.0 ** -25, 2.0 ** -14,
                       2.0 ** -133, 2.0 ** -149, 448.0, 464.0, 57344.0, 61440.0], dtype=torch.float64).to(dtype)
    idx = torch.randint(0, n, (max(1, n // 9),), generator=g)
    x[idx] = sp[torch.randint(0, len(sp), (len(idx),), generator=g)]
    return x


CASES = [(n, special) for n in (1, 9, 1023, 1024, 3000, 20_011) for special in (False, True)]


def _normal_values(dtype, n, seed):
    """Finite values with no subnormal in the input dtype (so whole chunks stay on the fast path,
    the bin table of fp32/bf16 inputs included), from far below the format's subnormals to far
    above its max, with values right around 65504, the fp16 normal and subnormal limits planted."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * torch.exp2(torch.randint(-60, 40, (n,), generator=g).double())
    near = torch.tensor([65504.0, 65505.0, 65519.0, 65519.99, 65520.0, 65535.9, 65536.0, -65504.5, -65536.0,
                         2.0 ** -14, 2.0 ** -14 * 0.999, 2.0 ** -24, 2.0 ** -25, 2.0 ** -24 * 1.5, 2.0 ** -26,
                         0.0, -0.0, 57344.0, 448.0, 464.0], dtype=torch.float64)
    idx = torch.randint(0, n, (max(1, n // 5),), generator=g)
    x[idx] = near[torch.randint(0, len(near), (len(idx),), generator=g)]
    x = x.to(dtype)
    fi = torch.finfo(dtype)
    return x.masked_fill(~torch.isfinite(x) | ((x != 0) & (x.abs() < fi.tiny)), 1.0)


@pytest.mark.parametrize("dtype", list(_stats_nvrtc.KINDS))
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_emulated_kernel_rows_equal_torch_path(build, dtype, fmt):
    get, tmp = build
    fmt = FORMATS[fmt]
    exe = get(dtype, fmt)
    width = stats.row_width(fmt)
    tensors = [_values(dtype, n, 1000 * n + special, special) for n, special in CASES]
    tensors += [_normal_values(dtype, n, n) for n in (1024, 5000, 20_480)]
    tensors += [torch.zeros(2048, dtype=dtype), torch.full((1500,), float("nan"), dtype=dtype),
                torch.full((1100,), 2.0 ** -130, dtype=dtype)]  # fp32/bf16 subnormals (fp16: 0)
    for i, t in enumerate(tensors):
        raw = tmp / "in.bin"
        res = tmp / "out.bin"
        t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32).numpy().tofile(raw)
        subprocess.run([str(exe), str(raw), str(res), str(t.numel()), str(CLEN), str(width)], check=True)
        got = np.fromfile(res, dtype=np.float64)
        ref = stats.tensor_stats(t, fmt).numpy()
        bad = np.nonzero(got != ref)[0].tolist()
        assert not bad, (i, t.numel(), [(stats.FIELDS[j] if j < stats.N_FIELDS else f"bin{j - stats.N_FIELDS}",
                                        got[j], ref[j]) for j in bad[:8]])


@pytest.mark.parametrize("sizes", [[0, 1, 1023, 1024, 1025, 1 << 16, (1 << 16) + 1, 3 << 20, 1 << 31],
                                   [0, 1, 768, 3072, 1 << 16, 589_824, 2_359_296]])  # (the second: weights)
def test_launch_tables_match_per_tensor_chunking(sizes):
    """The launch tables built in one numpy pass hold, per tensor, what ``chunking`` gives it at
    its table's ``table_chunk``, and the chunk offsets add up, across table boundaries (MAXT
    tensors a table)."""
    rng = np.random.default_rng(0)
    m = 2 * _stats_nvrtc.MAXT + 5
    numel = rng.choice(sizes, size=m)
    ptr = rng.integers(1, 1 << 40, size=m) * 16
    rows = rng.permutation(m)
    kinds = rng.integers(0, 3, size=m)
    got = _stats_nvrtc.tables(numel.tolist(), ptr.tolist(), rows.tolist(), kinds.tolist())
    T = _stats_nvrtc.MAXT
    assert len(got) == 3
    for j, t in enumerate(got):
        lo = j * T
        part = range(lo, min(lo + T, m))
        minc = _stats_nvrtc.table_chunk([int(numel[k]) for k in part])
        c = 0
        for i, k in enumerate(part):
            clen, nch = _stats_nvrtc.chunking(int(numel[k]), minc)
            assert (t[i], t[T + i], t[2 * T + i], t[3 * T + 1 + i], t[4 * T + 1 + i], t[5 * T + 1 + i]) == (
                ptr[k], numel[k], c, clen, rows[k], kinds[k])
            c += nch
        assert t[2 * T + len(part)] == c
        assert not t[len(part):T].any()  # unused entries stay zero


def test_table_chunk_shortens_only_tables_of_few_blocks():
    """A table of fewer than FEW_BLOCKS 64K-element chunks (a step's weights) chunks shorter, to
    about FEW_BLOCKS chunks, never below SMALL_CHUNK; chunk lengths stay multiples of ALIGN and
    cover every element; a table with enough chunks keeps MIN_CHUNK."""
    nv = _stats_nvrtc
    weights = [589_824] * 48 + [768] * 16  # 64 BERT-base-like parameters: 432 chunks of 64K
    minc = nv.table_chunk(weights)
    assert nv.SMALL_CHUNK <= minc < nv.MIN_CHUNK and minc % nv.ALIGN == 0
    blocks = sum(nv.chunking(n, minc)[1] for n in weights)
    assert nv.FEW_BLOCKS * 0.9 <= blocks <= nv.FEW_BLOCKS * 1.1, blocks
    assert sum(nv.chunking(n)[1] for n in weights) < nv.FEW_BLOCKS // 2
    assert nv.table_chunk([768] * 64) == nv.SMALL_CHUNK  # tiny tensors: one chunk each all the same
    assert nv.table_chunk([50_331_648] * 2) == nv.MIN_CHUNK  # 1536 chunks of 64K: enough
    for n in (1, 1023, 1025, 589_824, 3 << 20):
        clen, nch = nv.chunking(n, minc)
        assert clen % nv.ALIGN == 0 and (nch - 1) * clen < n <= nch * clen


def test_flags_kernel_bits(tmp_path):
    """The NaN/Inf flags kernel (ampdoctor/_flags_cuda_kernel.cu), built for the CPU: per tensor,
    1.0 exactly where numpy finds a NaN or an Inf, for fp16/bf16/fp32, sizes around its chunk and
    vector boundaries, NaN/Inf in the first, a middle and the last element; nothing is read past a
    tensor's end (the bytes there are NaN patterns); with the gate at 0 nothing at all."""
    exe = tmp_path / "flags"
    subprocess.run([CXX, "-O1", "-std=c++17", f"-I{EMU}", f'-DKERNEL_SOURCE="{_stats_nvrtc.FLAG_SOURCE}"', "-x", "c++",
                    str(EMU / "flags_driver.cpp"), "-o", str(exe)], check=True, capture_output=True)
    g = torch.Generator().manual_seed(5)
    chunk = _stats_nvrtc.FCHUNK
    kinds = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
    ints = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}
    tensors = []
    for dt in kinds:
        for n in (1, 7, 8, 9, 1000, chunk - 1, chunk, chunk + 3, 2 * chunk + 5):
            for where in (None, 0, n // 2, n - 1):
                x = (torch.randn(n, generator=g) * 1000).to(dt)
                if where is not None:
                    x[where] = (float("nan"), float("inf"), -float("inf"))[len(tensors) % 3]
                tensors.append(x)
    ref = [float(not np.isfinite(x.float().numpy()).all()) for x in tensors]
    for gate in (1, 0):
        got = []
        for lo in range(0, len(tensors), 60):  # several launches of up to 60 tensors
            args = []
            for i, x in enumerate(tensors[lo:lo + 60]):
                raw = tmp_path / f"t{lo + i}.bin"
                raw.write_bytes(x.view(ints[x.dtype]).numpy().tobytes())
                args += [str(raw), str(kinds[x.dtype]), str(x.numel())]
            res = tmp_path / "out.bin"
            subprocess.run([str(exe), str(res), str(gate), *args], check=True)
            got += np.fromfile(res, dtype=np.float64).tolist()
        assert got == (ref if gate else [0.0] * len(tensors))
    assert 0 < sum(ref) < len(ref)
