"""The HTML report: one self-contained file, every section, data: images only, names escaped; CSV too."""

from __future__ import annotations

import csv
import json
from html.parser import HTMLParser
from pathlib import Path

import pytest
from click.testing import CliRunner
from report_helpers import ODD_NAME, fp32_trace, overflow_trace

from ampdoctor.cli import main as cli
from ampdoctor.report import build_report
from ampdoctor.report.csvout import CSV_COLUMNS, write_csv
from ampdoctor.report.html import SECTION_IDS, render_html, write_html

BISECT = {
    "verdict": "culprit", "culprits": ["mid"], "failure": {"step": 4, "reason": "nonfinite_loss"},
    "first_nonfinite": {"layer": "mid", "kind": "activation", "step": 4},
    "ops": [{"layer": "mid", "op": "linear<b>", "where": "model.py:42", "absmax": None, "nonfinite": True,
             "phase": "forward", "pick": "first"}],
    "trials": [{"fp32": [], "outcome": "fail", "step": 4, "seconds": 1.5},
               {"fp32": ["mid"], "outcome": "pass", "step": None, "seconds": 1.2}],
    "fp32_control_losses": {"0": 1.0, "1": 0.9, "2": 0.8},
}


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()
        self.imgs: list[str] = []
        self.refs: list[str] = []
        self.scripts = 0
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids.add(a["id"])
        if tag == "img":
            self.imgs.append(a.get("src", ""))
        if tag == "script":
            self.scripts += 1
            assert "src" not in a
        if tag == "link":
            self.refs.append(a.get("href", ""))
        for k in ("href", "src"):
            if k in a and tag != "img":
                self.refs.append(a[k])

    def handle_data(self, data):
        self.text.append(data)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("run")
    overflow_trace(d / "trace.sqlite")
    return d


def _parse(text: str) -> _Page:
    p = _Page()
    p.feed(text)
    p.close()
    return p


def test_html_is_self_contained_with_every_section(run_dir, tmp_path):
    rep = build_report(run_dir)
    out = tmp_path / "sub" / "report.html"
    write_html(rep, out)
    text = out.read_text(encoding="utf-8")
    page = _parse(text)
    for sid in SECTION_IDS:
        assert sid in page.ids, sid
    for pid in ("plot-timeline", "plot-heatmap-activation", "plot-heatmap-gradient", "plot-hist-activation",
                "plot-hist-gradient", "plot-dtypes", "layers-activation", "layers-gradient"):
        assert pid in page.ids, pid
    assert len(page.imgs) >= 6
    assert all(src.startswith("data:image/png;base64,") for src in page.imgs)
    assert "http://" not in text and "https://" not in text and "//cdn" not in text
    assert all(r.startswith("#") for r in page.refs), page.refs
    assert page.scripts == 1  # ours: the table sorter
    body = "".join(page.text)
    assert "keep_fp32(model.mid)" in body and "Per-layer table" in body


def test_names_are_escaped(run_dir):
    rep = build_report(run_dir)
    assert any(r.layer == ODD_NAME for r in rep.layers)
    rep.diagnosis.lines.append("evil <img src=x onerror=alert(1)> & co")
    rep.notes.append("<b>bold</b>")
    text = render_html(rep)
    assert ODD_NAME not in text
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in text
    assert "<img src=x" not in text and "evil &lt;img src=x onerror=alert(1)&gt; &amp; co" in text
    assert "<b>bold</b>" not in text
    page = _parse(text)
    assert page.scripts == 1
    assert ODD_NAME in "".join(page.text)  # shown to the reader as text


def test_bisect_verdict_section(run_dir, tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    (d / "trace.sqlite").write_bytes((run_dir / "trace.sqlite").read_bytes())
    (d / "bisect.json").write_text(json.dumps(BISECT))
    text = render_html(build_report(d))
    page = _parse(text)
    body = "".join(page.text)
    assert "culprit" in body and "model.py:42" in body and "Trials (2)" in body
    assert "linear&lt;b&gt;" in text and "bisect verified" in body
    assert "step 4: nonfinite_loss" in body


def test_readiness_heading(tmp_path):
    text = render_html(build_report(fp32_trace(tmp_path / "t.sqlite", "fp16", 2e5)))
    body = "".join(_parse(text).text)
    assert "fp16 readiness" in body and "would overflow in fp16" in body


def test_csv_has_every_kind(run_dir, tmp_path):
    rep = build_report(run_dir)
    out = tmp_path / "t.csv"
    write_csv(rep, out)
    with open(out, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0].keys()) == CSV_COLUMNS
    assert len(rows) == len(rep.layers)
    assert {r["kind"] for r in rows} == {"activation", "gradient", "weight", "weight_grad"}
    mid = next(r for r in rows if r["layer"] == "mid" and r["kind"] == "activation")
    assert mid["headroom_bits"] == "-inf" and mid["first_bad_step"] == "4"
    assert any(r["layer"] == ODD_NAME for r in rows)


def test_cli_report_writes_html_and_csv(run_dir, tmp_path):
    html_path, csv_path = tmp_path / "r.html", tmp_path / "r.csv"
    res = CliRunner().invoke(cli, ["report", str(run_dir), "--html", str(html_path), "--csv", str(csv_path)])
    assert res.exit_code == 0, res.output
    assert html_path.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert csv_path.read_text(encoding="utf-8").startswith("kind,layer,")


def test_the_page_is_rendered_once_for_the_run_folder_and_html(run_dir, tmp_path, monkeypatch):
    """`run --out D --html F` (and `report D --html F`) rendered the whole page, plots and all (seconds),
    once for D/report.html and again for F. Once now; both files hold the same page."""
    import ampdoctor.report.html as html_mod
    from ampdoctor.cli import _write_outputs

    calls = []
    real = html_mod.render_html
    monkeypatch.setattr(html_mod, "render_html", lambda rep: calls.append(1) or real(rep))
    out = tmp_path / "out"
    out.mkdir()
    assert _write_outputs(build_report(run_dir), None, str(tmp_path / "r.html"), None, out)
    assert len(calls) == 1
    page = (out / "report.html").read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and page == (tmp_path / "r.html").read_text(encoding="utf-8")


def test_min_and_max_per_layer_match_numpy_in_json_csv_and_html(tmp_path):
    """The report's rows carry each layer's smallest and largest finite value over the recorded steps
    (the trace had them; the report showed only abs-max). NaN/Inf left out, a layer with no finite
    value has none (null / empty / -)."""
    import numpy as np
    import torch
    from torch import nn

    import ampdoctor

    class Planted(nn.Module):
        def forward(self, x):  # NaN and Inf planted where no gradient flows back
            col = torch.arange(4)
            return torch.where(col == 1, float("nan"), torch.where(col == 2, float("inf"), x))

    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    model = nn.Sequential(lin, Planted())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    seen: dict[str, list[np.ndarray]] = {"0": [], "1": []}
    hooks = [m.register_forward_hook(lambda m, i, o, k=k: seen[k].append(o.detach().numpy().copy()))
             for k, m in (("0", lin), ("1", model[1]))]
    with ampdoctor.watch(model, format="fp16", trace=str(tmp_path / "t.sqlite")) as w:
        for i in range(3):
            model(torch.randn(5, 4) * 10 ** i).nan_to_num(0.0, 0.0, 0.0).sum().backward()
            opt.step()
            opt.zero_grad()
        rep = w.report()
    for h in hooks:
        h.remove()
    js = json.loads(rep.to_json())
    for name, outs in seen.items():
        a = np.concatenate([o.ravel() for o in outs])
        fin = a[np.isfinite(a)]
        row = next(r for r in js["layers"] if r["layer"] == name and r["kind"] == "activation")
        assert (row["min"], row["max"]) == (float(fin.min()), float(fin.max())), (name, row)
    weight = next(r for r in rep.layers if r.layer == "0" and r.kind == "weight")
    wv = lin.weight.detach().numpy()
    assert weight.min <= float(wv.min()) and weight.max >= float(wv.max())  # (the bias is in the row too)
    out = tmp_path / "t.csv"
    write_csv(rep, out)
    with open(out, newline="", encoding="utf-8") as f:
        rows = {(r["layer"], r["kind"]): r for r in csv.DictReader(f)}
    assert float(rows[("1", "activation")]["max"]) == next(
        r.max for r in rep.layers if r.layer == "1" and r.kind == "activation")
    html = render_html(rep)
    assert "<th>min</th><th>max</th><th>abs-max</th>" in html


def test_a_layer_with_no_finite_value_has_no_min_max_or_absmax_anywhere(tmp_path):
    """A layer whose values were all NaN had min +inf, max -inf and abs-max 0 in the JSON, the CSV, the
    terminal and the HTML (0 reads as 'all zeros'). Every output now says none (null / empty / -), and
    a layer with finite values keeps numpy's min, max and abs-max of what its hooks saw."""
    import numpy as np
    import torch
    from torch import nn

    import ampdoctor
    from ampdoctor.report.text import render_text

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 1)

        def forward(self, x):
            h = (self.a(x) * 3e5) ** 2  # Inf in fp16
            return self.b(h - h)  # Inf - Inf: every value NaN from step 0 on

    torch.manual_seed(0)
    m = M()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    seen: dict[str, list[np.ndarray]] = {"a": [], "b": []}
    hooks = [getattr(m, k).register_forward_hook(lambda mod, i, o, k=k: seen[k].append(o.detach().float().numpy()))
             for k in seen]
    with ampdoctor.watch(m, format="fp16", trace=str(tmp_path / "t.sqlite")) as w:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(torch.randn(4, 8) * 1000).float().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        rep = w.report()
    for h in hooks:
        h.remove()
    b_out = np.concatenate([o.ravel() for o in seen["b"]])
    assert not np.isfinite(b_out).any()  # the planted case
    a_out = np.concatenate([o.ravel() for o in seen["a"]])
    fin = a_out[np.isfinite(a_out)]
    js = {(r["layer"], r["kind"]): r for r in json.loads(rep.to_json())["layers"]}
    assert (js[("a", "activation")]["min"], js[("a", "activation")]["max"]) == (float(fin.min()), float(fin.max()))
    assert js[("a", "activation")]["absmax"] == float(np.abs(fin).max())
    nothing = [k for k, r in js.items() if r["nan"] + r["inf"] == r["numel"]]
    assert ("b", "activation") in nothing and ("a", "weight") in nothing, sorted(js)
    for k in nothing:
        assert (js[k]["min"], js[k]["max"], js[k]["absmax"], js[k]["headroom_bits"]) == (None, None, None, None), js[k]
    out = tmp_path / "t.csv"
    write_csv(rep, out)
    with open(out, newline="", encoding="utf-8") as f:
        rows = {(r["layer"], r["kind"]): r for r in csv.DictReader(f)}
    for k in nothing:
        assert [rows[k][c] for c in ("min", "max", "absmax", "headroom_bits")] == ["", "", "", ""], rows[k]
    assert float(rows[("a", "activation")]["absmax"]) == float(np.abs(fin).max())
    text = render_text(rep, kinds=("activation",))
    line = next(ln for ln in text.splitlines() if ln.startswith("b ") and "Linear" in ln)
    assert line.split()[3:5] == ["-", "-"], line
    html = render_html(rep)
    assert ">inf<" not in html and ">-inf<" not in html
