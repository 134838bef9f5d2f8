"""bisect end to end where the oracle's timing decides the verdict: a GradScaler's long start-up
backoff, the step a search trial reports, and a divergence that is not precision's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
SCRIPTS = Path(__file__).parent / "scripts"


def bisect(*args, timeout=600):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("AMPDOCTOR_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "ampdoctor", "bisect", *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=timeout)


def test_huge_init_scale_backing_off_is_healthy(tmp_path):
    """init_scale=2**40 on a healthy model: every step is skipped until the scale has halved to 2**16 (24
    steps), then it trains. Called skipped_steps at step 0, and bisect named 0, 2, 4 the culprits (13 trials)."""
    p = bisect("--out", tmp_path / "b", "--json", tmp_path / "r.json", "--no-drill", SCRIPTS / "huge_init_scale.py")
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["verdict"] == "healthy" and p.returncode == 0, p.stdout + p.stderr
    assert len(res["trials"]) == 1 and res["trials"][0]["step"] == 50, res["trials"]


@pytest.mark.parametrize("script_args", [(), ("--backward",)])
def test_search_trials_report_nonfinite_params_where_the_baseline_does(tmp_path, script_args):
    """SGD writes NaN into the weights at step 5 (its loss Inf). The baseline checks the weights every
    step and said nonfinite_params at 5; a search trial checked them only after a non-finite loss, and
    said 6 for the same failure. ``--backward``: only the backward overflows, the loss of step 5 is
    finite (NaN from 6): the trials said 6 until they checked the weights at every step."""
    bisect("--out", tmp_path / "b", "--json", tmp_path / "r.json", "--no-drill", "--max-trials", "4",
           SCRIPTS / "params_nan.py", *script_args)
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["failure"] == {"step": 5, "reason": "nonfinite_params"}, res
    reasons = [d["reason"] for d in res["trial_details"]]
    fails = [(t, r) for t, r in zip(res["trials"][1:], reasons[1:]) if t["outcome"] == "fail"]
    assert fails and all(t["step"] == 5 and r == "nonfinite_params" for t, r in fails), res["trials"]


def test_a_run_that_diverges_in_fp32_too_is_not_precision(tmp_path):
    """A learning rate too high: the fp16 run's scale collapses at step 47, the FP32 run's loss grows too
    and turns non-finite at step 112. The all-FP32 control passed at step 70 (the failure step + margin),
    and bisect named both heads the culprits. It now fails as soon as its loss is 100x its first steps'."""
    p = bisect("--out", tmp_path / "b", "--json", tmp_path / "r.json", "--no-drill", SCRIPTS / "lr_diverges.py")
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["verdict"] == "not_precision" and p.returncode == 3, p.stdout + p.stderr
    assert res["failure"] == {"step": 47, "reason": "scale_collapse"}, res["failure"]
    base, ctl, off = res["trials"]
    assert ctl["fp32"] == [""] and ctl["outcome"] == "fail" and res["trial_details"][1]["reason"] == "divergence"
    # the control's loss: 0.85 at step 0 (first five steps' mean 0.42), 47 at step 12
    assert ctl["step"] == 12, ctl
    assert "the loss grew over 100x its first steps' from step 12" in p.stdout, p.stdout
    # with autocast off in the whole script too it diverges: not the script's own code under autocast either
    assert off == {**off, "fp32": [""], "autocast": False, "outcome": "fail"} and res["autocast_off_control"] == "fail", res
    assert "not a precision problem" in p.stdout and "with autocast off in the whole script it fails too" in p.stdout


def test_a_loss_computed_under_autocast_is_not_called_not_a_precision_problem(tmp_path):
    """A contrastive loss's z @ z.T under autocast (fp16 whatever its inputs) overflows: every layer in FP32
    still breaks, so bisect said 'not a precision problem (learning rate, data, a bug?)' and the report told
    to compute the loss as loss_fn(out.float(), y), inside the block, which does not help. A control with
    every autocast region of the script off now tells the two apart."""
    from ampdoctor.report import build_report
    from ampdoctor.report.culprit import OUTSIDE_MODEL
    p = bisect("--out", tmp_path / "b", "--json", tmp_path / "r.json", SCRIPTS / "loss_matmul_under_autocast.py")
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["verdict"] == "not_precision" and p.returncode == 3, p.stdout + p.stderr  # (every layer in FP32 breaks)
    assert [(t["fp32"], t["outcome"], t.get("autocast", True)) for t in res["trials"]] == [
        ([], "fail", True), ([""], "fail", True), ([""], "pass", False)], res["trials"]
    assert res["autocast_off_control"] == "pass" and res["advice"][0].startswith(OUTSIDE_MODEL), res["advice"]
    assert "the loss was non-finite at step 0 while every watched layer's output was finite" in res["advice"][0]
    out = " ".join(p.stdout.split())
    assert "trains with autocast off in the whole script" in out and "not a precision problem" not in out, out
    assert "fp32=[(whole model); autocast off] -> pass" in " ".join(p.stderr.split()), p.stderr
    rep = build_report(tmp_path / "b")
    assert rep.advice[0] == res["advice"][0], rep.advice
    assert not any("not a precision problem" in a or "loss_fn(out.float(), y)`)" in a for a in rep.advice), rep.advice


def test_the_all_fp32_control_runs_twice_as_far(tmp_path):
    """Without the blow-up check the control still runs to twice the other trials' pass_after (140 here),
    past step 112, where the FP32 loss turns non-finite."""
    p = bisect("--out", tmp_path / "b", "--json", tmp_path / "r.json", "--no-drill", "--control-blowup", "0",
               SCRIPTS / "lr_diverges.py")
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["verdict"] == "not_precision", p.stdout + p.stderr
    assert (res["pass_after"], res["control_pass_after"]) == (70, 140), res
    assert res["trials"][1]["step"] == 112 and res["trial_details"][1]["reason"] == "nonfinite_loss", res["trials"]
    assert "with every layer in FP32 it fails too: nonfinite_loss at step 112" in p.stdout


def test_control_blowup_is_checked():
    from click.testing import CliRunner

    from ampdoctor.bisect.cli import bisect_command

    for bad in ("1", "0.5", "-3", "nan"):
        r = CliRunner().invoke(bisect_command, ["--control-blowup", bad, str(SCRIPTS / "lr_diverges.py")])
        assert r.exit_code == 2 and "--control-blowup" in r.output and "a factor > 1, or 0" in r.output, (bad, r.output)


def test_the_control_gets_twice_the_default_timeout(tmp_path):
    """It runs twice as far as the other trials: with the default per-trial timeout (3x the baseline +
    30 s) a slow script's control would time out (inconclusive) where it would have passed."""
    from ampdoctor.bisect.driver import BisectOptions, run_bisect
    from ampdoctor.bisect.trials import TrialRunner

    class Recording(TrialRunner):
        calls: list = []

        def start(self, name, fp32, **kw):
            self.calls.append((name, kw))
            return super().start(name, fp32, **kw)

    runner = Recording(str(SCRIPTS / "lr_diverges.py"), [], tmp_path, oracle={})
    res = run_bisect(str(SCRIPTS / "lr_diverges.py"), [], tmp_path, BisectOptions(drill=False), runner=runner)
    assert res["verdict"] == "not_precision", res
    (name, kw), = [c for c in runner.calls if c[0] == "all-fp32"]
    assert runner.timeout >= 60 and kw["timeout"] == 2 * runner.timeout, (runner.timeout, kw)
    assert kw["pass_after"] == 140 and kw["oracle"] == {"blowup": 100.0}, kw
    # a trial's own timeout is the one it is stopped at
    hang = TrialRunner(str(SCRIPTS / "hangs.py"), [], tmp_path / "h", oracle={}, timeout=600)
    t = hang.wait(hang.start("hang", [], pass_after=None, timeout=3))
    assert t.outcome == "timeout" and t.seconds < 30 and "killed after 3s" in t.error, t


def test_weights_nan_from_a_checkpoint_are_named_as_such(tmp_path):
    """Training resumed from a checkpoint whose weights are NaN already: the run's report and bisect
    name those weights (`at_start`), not the first layer whose output their NaN reached as the
    producer ("from finite inputs", with keep_fp32 advice), and bisect says not_precision."""
    from ampdoctor.report import build_report

    script = Path(__file__).parent / "scripts" / "nan_checkpoint.py"
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "ampdoctor", "run", "--out", str(out), str(script)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rep = build_report(out)
    assert rep.diagnosis.first_nonfinite["at_start"] and rep.diagnosis.first_nonfinite["layer"] == "2"
    text = " ".join(rep.diagnosis.lines)
    assert "the weights of 2 were already NaN/Inf when watch() began" in text and "from finite inputs" not in text
    assert not any("keep_fp32" in a for a in rep.advice), rep.advice
    b = subprocess.run([sys.executable, "-m", "ampdoctor", "bisect", "--out", str(tmp_path / "b"), "--json",
                        str(tmp_path / "b.json"), str(script)], capture_output=True, text=True, timeout=300)
    res = json.loads((tmp_path / "b.json").read_text())
    assert res["verdict"] == "not_precision", b.stdout
    assert res["first_nonfinite"] == {"layer": "2", "kind": "weight", "step": 0, "at_start": True}
    assert "the weights of 2, already NaN/Inf when the run began" in b.stdout
