"""Time and peak memory of building the report of a large trace: ``build_report``, then the text
table, the JSON (with and without histograms) and the HTML page, as ``ampdoctor report`` does.

The trace is synthetic but goes through the real writer (:class:`ampdoctor.trace.TraceWriter`,
``add_stat_rows``: the writer process, the rows the watch writes): a deep MLP of ``--layers``
Linear layers, ``--steps`` steps of fp16 autocast with a GradScaler, every step recorded. Each layer
and step gives the six rows a watched Linear gives (its output, the output's gradient, the weight
and bias, their gradients), with exponent histograms shaped like real ones (a bell of binades below
the abs-max, drifting per layer and step). Every 97th step one gradient overflows to Inf (a
GradScaler backoff, the step skipped); from 90% of the run on, a layer in the middle overflows in
forward, the layers after it and every gradient go NaN, the loss is NaN and every step is skipped.

The report is measured in a fresh process (``--report-only``), so its peak RSS (``ru_maxrss``) is
the report's alone; the RSS after the imports (torch, matplotlib) is printed beside it.

Run:  python benchmarks/report_scale.py [--layers 200] [--steps 500] [--trace PATH] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ampdoctor.formats import get_format  # noqa: E402
from ampdoctor.stats import N_FIELDS  # noqa: E402
from ampdoctor.trace import TraceWriter  # noqa: E402

WIDTH = 256   # features of every Linear (B=32 rows of activations)
BATCH = 32
BELL = np.array([1.0 / 2 ** k for k in range(14)])  # share of the values k binades below the top one
BELL /= BELL.sum()


def _rows(fmt, numel: np.ndarray, top: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Statistics rows (``stats.FIELDS`` then the histogram) of tensors of ``numel`` values whose
    largest binade is ``top``: a bell of binades below it, clipped into the under/over bins."""
    n, nb = len(numel), fmt.n_bins
    out = np.zeros((n, N_FIELDS + nb))
    zero = (numel * 0.01).astype(np.int64)
    counts = np.floor((numel - zero)[:, None] * BELL[None, :]).astype(np.int64)
    counts[:, 0] += (numel - zero) - counts.sum(axis=1)
    exps = top[:, None] - np.arange(len(BELL))[None, :]
    idx = np.clip(exps - fmt.min_exp + 1, 0, nb - 1)
    hist = np.zeros((n, nb), dtype=np.int64)
    np.add.at(hist, (np.repeat(np.arange(n), len(BELL)), idx.ravel()), counts.ravel())
    absmax = 2.0 ** top * (1.0 + rng.random(n) * 0.99)
    lowest = np.where(counts > 0, exps, 10 ** 6).min(axis=1)
    out[:, 0] = numel
    out[:, 4] = zero
    out[:, 5] = -absmax
    out[:, 6] = absmax * 0.93
    out[:, 7] = absmax
    out[:, 8] = 2.0 ** lowest.astype(float)
    out[:, 9] = hist[:, -1]                                          # overflow: the over bin
    out[:, 10] = hist[:, 1:1 + fmt.normal_exp - fmt.min_exp].sum(axis=1)  # subnormal binades
    out[:, 11] = hist[:, 0]                                          # flushed: the under bin
    out[:, N_FIELDS:] = hist
    return out


def build_trace(path: Path, layers: int, steps: int, seed: int = 0) -> None:
    """Write the synthetic trace (see the module doc) with the real writer."""
    fmt = get_format("fp16")
    rng = np.random.default_rng(seed)
    w = TraceWriter(path)
    w.set_meta(format=fmt.name, format_detected="autocast to float16", every=1, started=time.time(), status="running",
               argv=["deep_mlp.py"], torch="synthetic", rank=0, pid=os.getpid(), host="benchmark", force_fp32=[],
               python=sys.version.split()[0])
    w.add_layers([(0, "", "Sequential", 0, 0, None)] +
                 [(i + 1, str(i), "Linear", i + 1, 1, 0) for i in range(layers)])
    ids = np.arange(1, layers + 1)
    # per row of a step: activation (forward order), gradient (backward order), weight_grad, weight
    meta = ([(int(i), "activation", "out", 0, "float16", BATCH * WIDTH, 2 * BATCH * WIDTH) for i in ids]
            + [(int(i), "gradient", "out", 0, "float16", BATCH * WIDTH, 2 * BATCH * WIDTH) for i in ids[::-1]]
            + [(int(i), k, s, 0, "float32", n, 4 * n) for k in ("weight_grad", "weight") for i in ids
               for s, n in (("weight", WIDTH * WIDTH), ("bias", WIDTH))])
    numel = np.array([m[5] for m in meta], dtype=np.int64)
    kind = np.array([m[1] for m in meta])
    lid = np.array([m[0] for m in meta])
    base = np.select([kind == "activation", kind == "gradient", kind == "weight_grad"],
                     [1 + (lid % 5), -2 + (lid % 7), -4 + (lid % 6)], -3 - (lid % 3))
    broke = int(steps * 0.9) if steps >= 10 else steps
    bad_layer = layers // 2 + 1
    scale = 65536.0
    stepped = 0
    t0 = time.perf_counter()
    for step in range(steps):
        drift = (step * 3) // max(steps, 1)
        top = base + drift + rng.integers(-1, 2, size=len(meta))
        grads = (kind == "gradient") | (kind == "weight_grad")
        top = np.where(grads, top + int(np.log2(scale)) - 16, top)
        host = _rows(fmt, numel, top, rng)
        overflow_step = step % 97 == 96 and step < broke
        if overflow_step:  # one gradient overflows: Inf, the GradScaler skips and backs off
            r = int(np.flatnonzero(kind == "gradient")[0])
            host[r, 2] = 1
        if step >= broke:  # the middle layer overflows in forward; NaN after it and in every gradient
            r = int(np.flatnonzero((kind == "activation") & (lid == bad_layer))[0])
            host[r, 2] = 7
            host[r, N_FIELDS + fmt.n_bins - 1] += 3
            host[r, 9] += 3
            nan = ((kind == "activation") & (lid > bad_layer)) | grads
            host[nan, 1] = numel[nan]
            host[nan, 4] = 0
            host[nan, 5], host[nan, 6], host[nan, 7], host[nan, 8] = np.inf, -np.inf, 0.0, np.inf
            host[nan, 9:] = 0
        w.add_stat_rows(step, meta, host, N_FIELDS)
        skipped = overflow_step or step >= broke
        loss = float("nan") if step >= broke else float(2.0 * np.exp(-step / max(steps, 1)))
        if step == broke:
            w.add_event(step, "first_nonfinite", str(bad_layer - 1), kind="activation", call=0, producers=1)
        if skipped:
            w.add_event(step, "grad_nonfinite", str(layers - 1 if step < broke else bad_layer - 1), kind="gradient",
                        scaled=True)
            scale /= 2
        else:
            stepped += 1
        w.add_step((step, loss, scale, int(skipped), stepped, 1, float(step)))
        w.commit()
        if step % 50 == 49:
            w.flush(timeout=600)  # keep the queue short: the writer process sets the pace
    w.set_meta(status="finished", ended=time.time(), steps=steps)
    w.commit()
    w.close(timeout=3600)
    print(f"# trace: {layers} layers x {steps} steps, {steps * len(meta)} stats rows, "
          f"{path.stat().st_size / 1e9:.2f} GB, written in {time.perf_counter() - t0:.1f} s", flush=True)


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def measure(trace: Path, out: Path) -> dict:
    """Build the report of ``trace`` and render it; seconds per stage and peak RSS (this process)."""
    import ampdoctor.report.html as html
    from ampdoctor.report import build_report
    res: dict = {"rss_after_imports_mb": _rss_mb()}
    t = time.perf_counter()
    report = build_report(trace)
    res["build_report_s"] = time.perf_counter() - t
    t = time.perf_counter()
    text = report.to_text()
    res["text_s"] = time.perf_counter() - t
    t = time.perf_counter()
    report.to_json(out / "report.json")
    report.to_json(out / "report.hist.json", hist=True)
    res["json_s"] = time.perf_counter() - t
    t = time.perf_counter()
    html.write_html(report, out / "report.html")
    res["html_s"] = time.perf_counter() - t
    res["total_s"] = res["build_report_s"] + res["text_s"] + res["json_s"] + res["html_s"]
    res["peak_rss_mb"] = _rss_mb()
    res["text_lines"] = text.count("\n")
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=200)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--trace", type=Path, default=None, help="trace to use; written there first if it does not exist")
    p.add_argument("--keep", action="store_true", help="keep the trace and the reports (printed where)")
    p.add_argument("--report-only", type=Path, default=None, help=argparse.SUPPRESS)  # the measuring child
    p.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.report_only is not None:
        print(json.dumps(measure(a.report_only, a.out)))
        return
    tmp = Path(tempfile.mkdtemp(prefix="ampdoctor-report-scale-"))
    trace = a.trace or tmp / "trace.sqlite"
    if not trace.exists():
        build_trace(trace, a.layers, a.steps)
    else:
        print(f"# trace: {trace} ({trace.stat().st_size / 1e9:.2f} GB), as it is")
    child = subprocess.run([sys.executable, __file__, "--report-only", str(trace), "--out", str(tmp)],
                           capture_output=True, text=True)
    if child.returncode:
        sys.stderr.write(child.stderr)
        raise SystemExit(child.returncode)
    res = json.loads(child.stdout.strip().splitlines()[-1])
    print(f"# {a.layers} layers x {a.steps} steps; Python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    print("| stage | seconds |\n|---|---|")
    for k in ("build_report_s", "text_s", "json_s", "html_s", "total_s"):
        print(f"| {k[:-2]} | {res[k]:.2f} |")
    print(f"peak RSS {res['peak_rss_mb']:.0f} MB (after imports {res['rss_after_imports_mb']:.0f} MB); "
          f"text report {res['text_lines']} lines")
    if a.keep:
        print(f"# kept: {tmp}")
    else:
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()


if __name__ == "__main__":
    main()
