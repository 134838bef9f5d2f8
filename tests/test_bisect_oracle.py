"""bisect end to end where the oracle's timing decides the verdict: a GradScaler's long start-up
backoff, the step a search trial reports, and a divergence that is not precision's."""

import json
import os
import subprocess
import sys
from pathlib import Path

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


def test_search_trials_report_nonfinite_params_where_the_baseline_does(tmp_path):
    """SGD writes NaN into the weights at step 5 (its loss Inf). The baseline checks the weights every
    step and said nonfinite_params at 5; a search trial checks them only after a non-finite loss, and
    said 6 for the same failure."""
    bisect("--out", tmp_path / "b", "--json", tmp_path / "r.json", "--no-drill", "--max-trials", "4",
           SCRIPTS / "params_nan.py")
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["failure"] == {"step": 5, "reason": "nonfinite_params"}, res
    reasons = [d["reason"] for d in res["trial_details"]]
    fails = [(t, r) for t, r in zip(res["trials"][1:], reasons[1:]) if t["outcome"] == "fail"]
    assert fails and all(t["step"] == 5 and r == "nonfinite_params" for t, r in fails), res["trials"]
