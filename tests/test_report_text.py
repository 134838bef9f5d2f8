"""The terminal report against an expected-output file (regenerate: pytest --regen-expected)."""

import json
from pathlib import Path

import numpy as np
from report_helpers import synthetic_trace

from ampdoctor.formats import get_format
from ampdoctor.report import build_report
from ampdoctor.report.text import select_rows
from ampdoctor.trace import TraceWriter, hist_blob

EXPECTED = Path(__file__).parent / "expected"
FMT = get_format("fp16")


def _row(step, layer, kind, absmax, *, nan=0, inf=0, overflow=0, sub=0, ftz=0, numel=1024, dtype="float16", call=0):
    hist = np.zeros(FMT.n_bins, dtype=np.int64)
    hist[1 + 0 - FMT.min_exp] = numel - nan - inf
    return (step, layer, kind, "out", call, dtype, numel, numel * 2, nan, inf, 0, 0, -absmax, absmax, absmax, 1e-3,
            overflow, sub, ftz, hist_blob(hist))


def synthetic(path: Path) -> Path:
    """Three layers, four steps; layer `blocks.1.proj` overflows at step 2 and is NaN at step 3."""
    w = TraceWriter(path)
    w.set_meta(format="fp16", every=1, status="finished", optimizer_steps=2, rank=0, argv=["train.py"])
    w.add_layers([(0, "", "Net", 0, 0, None), (1, "embed", "Linear", 1, 1, 0), (2, "blocks.1.proj", "Linear", 2, 1, 0),
                  (3, "head", "Linear", 3, 1, 0)])
    rows = []
    for step in range(4):
        rows.append(_row(step, 1, "activation", 3.5))
        big = [100.0, 3000.0, 70000.0, 0.0][step]
        rows.append(_row(step, 2, "activation", big if step < 3 else 0.0, overflow=8 if step == 2 else 0,
                         nan=1024 if step == 3 else 0, sub=4 if step == 0 else 0))
        rows.append(_row(step, 3, "activation", 1.5, nan=1024 if step == 3 else 0, call=0))
        rows.append(_row(step, 3, "activation", 1.25, call=1))
        rows.append(_row(step, 2, "gradient", 2.0 ** 10, ftz=100 if step == 1 else 0))
    w.add_stats(rows)
    for step, (loss, scale, skipped) in enumerate([(2.0, 65536.0, 0), (1.5, 65536.0, 0), (1.2, 32768.0, 1),
                                                   (float("nan"), 16384.0, 1)]):
        w.add_step((step, loss, scale, skipped, min(step + 1, 2), 1, 1000.0 + step))  # no optimizer step when skipped
    w.add_event(3, "first_nonfinite", "blocks.1.proj", kind="activation", call=0, producers=2)
    w.commit()
    w.close()
    return path


def _check(name: str, text: str, regen: bool) -> None:
    target = EXPECTED / name
    if regen:
        target.write_text(text)
    assert target.exists(), f"{target} missing: run pytest --regen-expected"
    assert text == target.read_text()


def _body(text: str) -> str:
    return "\n".join(text.splitlines()[1:]) + "\n"  # the first line names the (temporary) trace path


def test_text_report_matches_expected(tmp_path, regen):
    rep = build_report(synthetic(tmp_path / "trace.sqlite"))
    _check("report_synthetic.txt", _body(rep.to_text(width=120)), regen)
    _check("report_synthetic_worst.txt", _body(rep.to_text(width=120, sort="worst", top=2, kinds=["activation"])), regen)


def test_json_report_has_the_same_rows(tmp_path):
    rep = build_report(synthetic(tmp_path / "trace.sqlite"))
    data = json.loads(rep.to_json())
    proj = [r for r in data["layers"] if r["layer"] == "blocks.1.proj" and r["kind"] == "activation"][0]
    assert proj["overflow"] == 8 and proj["nan"] == 1024 and proj["first_bad_step"] == 2
    assert abs(proj["headroom_bits"] - (-0.0958)) < 1e-3  # log2(65504 / 70000): a plain number, not inf
    head = [r for r in data["layers"] if r["layer"] == "head" and r["kind"] == "activation"][0]
    assert head["calls"] == 2
    assert data["diagnosis"]["first_nonfinite"]["layer"] == "blocks.1.proj"


def test_json_timeline_tells_a_nan_loss_from_no_loss(tmp_path):
    """JSON has no NaN: a NaN loss is "nan" (as an Inf one is "inf"), a step without a loss recorded is null."""
    losses = [1.0, float("nan"), None, float("inf"), float("-inf")]
    path = synthetic_trace(tmp_path / "t.sqlite", grad_exps=[(0, 10)], scales=[None] * 5, losses=losses)
    data = json.loads(build_report(path).to_json())
    assert [t["loss"] for t in data["timeline"]] == [1.0, "nan", None, "inf", "-inf"]
    assert [t["step"] for t in data["timeline"]] == [0, 1, 2, 3, 4]


def test_a_selection_that_shows_nothing_says_so(tmp_path):
    rep = build_report(synthetic(tmp_path / "trace.sqlite"))
    text = rep.to_text(width=120, only_bad=True, kinds=["gradient"], match="embed")
    assert "No layer with NaN/Inf, overflow, subnormal or flushed values matching 'embed' among gradient." in text
    assert "No layer" not in rep.to_text(width=120, only_bad=True)  # blocks.1.proj is bad: its rows show


def test_worst_first_puts_the_producer_before_what_it_passed_on():
    from ampdoctor.report.model import LayerRow

    def row(layer, order, nan=0, overflow=0, first=None, headroom=5.0):
        return LayerRow(layer=layer, type="Linear", order=order, kind="activation", dtype="float16", absmax=1.0,
                        headroom_bits=headroom, numel=10, overflow=overflow, subnormal=0, flush_to_zero=0, nan=nan,
                        inf=0, overflow_pct=0.0, subnormal_pct=0.0, flush_pct=0.0, first_bad_step=first, calls=1,
                        bytes=20, steps=1)

    rows = [row("tight", 0, headroom=0.5), row("producer", 1, nan=2, first=3), row("later", 2, nan=1000, first=3),
            row("earlier", 5, overflow=1, first=1), row("fine", 3, headroom=9.0)]
    assert [r.layer for r in sorted(rows, key=LayerRow.severity)] == ["earlier", "producer", "later", "tight", "fine"]


def _train_watched(model, path, steps=2, scale=1.0):
    import torch

    import ampdoctor

    opt = torch.optim.SGD(model.parameters(), 1e-4)
    sc = torch.amp.GradScaler("cpu")
    with ampdoctor.watch(model, trace=str(path)):
        for _ in range(steps):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 8) * scale).float().pow(2).mean()
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
            opt.zero_grad()
    return build_report(path)


def test_worst_first_puts_the_producer_before_a_module_called_before_and_after_it(tmp_path):
    """A ReLU called twice, before the producer and after it (it passes the producer's Inf on): its row
    is ordered by its first call, so worst-first put it above the producer that the diagnosis names."""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.big, self.out, self.act = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1), nn.ReLU()
            with torch.no_grad():
                self.big.weight.fill_(3000.0)

        def forward(self, x):
            return self.out(self.act(self.big(self.act(self.inp(x)))))

    torch.manual_seed(0)
    rep = _train_watched(Net(), tmp_path / "t.sqlite", scale=10.0)
    assert (rep.diagnosis.first_nonfinite or {}).get("layer") == "big", rep.diagnosis
    rows = [r.layer for r in select_rows(rep, "activation", sort="worst")]
    assert rows[0] == "big" and rows.index("act") < rows.index("out"), rows
    grads = [r for r in select_rows(rep, "gradient", sort="worst") if r.bad]
    if len(grads) > 1 and rep.diagnosis.first_nonfinite["kind"] == "activation":  # backward order at one step
        same = [r for r in grads if r.first_bad_step == grads[0].first_bad_step]
        assert [r.order for r in same] == sorted((r.order for r in same), reverse=True), [r.layer for r in same]


def test_long_layer_names_are_not_cut(tmp_path):
    """Layer names longer than the table's share of 120 columns were cut with an ellipsis, and their end
    is what tells blocks.3.attention.query_projection from blocks.3.attention.value_projection. They
    fold onto a second line instead; the CLI takes the terminal's width (COLUMNS), 160 into a pipe."""
    import torch
    from click.testing import CliRunner
    from torch import nn

    from ampdoctor.cli import main as cli

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.query_projection_layer_with_a_long_name = nn.Linear(8, 8)
            self.value_projection_layer_with_a_long_name = nn.Linear(8, 8)

        def forward(self, x):
            return self.query_projection_layer_with_a_long_name(x) + self.value_projection_layer_with_a_long_name(x)

    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("encoder_attention_block", Attention())
    model.add_module("head", nn.Linear(8, 1))
    rep = _train_watched(model, tmp_path / "t.sqlite")
    names = [r.layer for r in rep.rows("activation")]
    assert any(len(n) > 60 for n in names), names
    text = rep.to_text(width=120)
    assert "…" not in text
    folded = "".join(line.split(" ")[0] for line in text.splitlines())
    assert all(n in folded for n in names), text
    wide = CliRunner().invoke(cli, ["report", str(tmp_path / "t.sqlite")], env={"COLUMNS": "200"})
    assert wide.exit_code == 0, wide.output
    assert all(any(line.startswith(n + " ") for line in wide.output.splitlines()) for n in names), wide.output
    assert max(len(line) for line in wide.output.splitlines()) > 120


def test_a_report_that_cannot_be_written_whole_leaves_none_and_keeps_the_last(tmp_path):
    # a full disk while report.json/html is written (here a file size limit, which fails the write the
    # same way): no truncated file, an earlier report at the path stays as it was, no temporary left
    import subprocess
    import sys
    p = tmp_path / "report.json"
    p.write_text('{"old": true}')
    code = ("import resource, sys; from ampdoctor.report.model import write_whole\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
            "try:\n    write_whole(sys.argv[1], 'x' * 100_000)\nexcept OSError as e:\n    print('failed', e.errno)\n"
            "write_whole(sys.argv[2], 'small')\n")
    r = subprocess.run([sys.executable, "-c", code, str(p), str(tmp_path / "new.json")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("failed"), r.stderr
    assert p.read_text() == '{"old": true}'
    assert (tmp_path / "new.json").read_text() == "small"
    assert sorted(f.name for f in tmp_path.iterdir()) == ["new.json", "report.json"]


def test_a_sampled_run_does_not_say_nan_spread_through_the_updates(tmp_path):
    """--every 5: the loss was NaN at step 3 (not recorded in detail); the first non-finite value recorded is
    step 5's, a layer's output, with the weights still finite. The diagnosis said "when NaN had spread
    through the updates", which nothing recorded showed."""
    from ampdoctor.report import build_report
    from ampdoctor.trace import TraceWriter

    w = TraceWriter(tmp_path / "t.sqlite")
    w.set_meta(format="fp16", every=5, status="finished", argv=["synthetic"])
    w.add_layers([(0, "lin", "Linear", 0, 1, None)])
    for step in range(8):
        loss = float("nan") if step >= 3 else 1.0
        w.add_step((step, loss, 2.0 ** (16 - max(0, step - 2)), int(step >= 3), step + 1, int(step in (0, 5)),
                    float(step)))
    w.add_event(5, "first_nonfinite", "lin", kind="activation", call=0, producers=1)
    w.commit()
    w.close()
    text = " ".join("\n".join(build_report(tmp_path / "t.sqlite").diagnosis.lines).split())
    assert "The loss was non-finite from step 3" in text and "step 5, a forward output of lin" in text, text
    assert "spread through the updates" not in text, text
    assert "may have made it again there, or passed on a NaN the earlier steps left" in text, text
