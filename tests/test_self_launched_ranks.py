"""A DDP script that launches its other ranks itself by running its own file again (PyTorch
Lightning's default DDP launcher does): under `ampdoctor run`/`bisect` those ranks run under
ampdoctor too (their own traces, the trial's layers forced to FP32), through ampdoctor/_boot's
sitecustomize, which leaves everything else as it was."""

import json
import os
import subprocess
import sys
from pathlib import Path

from ampdoctor import rank_boot
from ampdoctor.trace import TraceReader

HERE = Path(__file__).parent
ROOT = HERE.parent
SCRIPT = HERE / "scripts" / "self_launched_ddp.py"


def amp(*args, env=None, timeout=300):
    e = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    for k in ("AMPDOCTOR_CONFIG", rank_boot.SCRIPT_VAR, rank_boot.PARENT_VAR, rank_boot.SAVED_VAR):
        e.pop(k, None)
    return subprocess.run([sys.executable, "-m", "ampdoctor", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, env=e, timeout=timeout)


def _steps(path):
    r = TraceReader(path)
    return r.meta(), {s["step"] for s in r.stats()}


def test_run_traces_a_rank_the_script_launched_itself_and_chains_the_users_sitecustomize(tmp_path):
    user = tmp_path / "site"
    user.mkdir()
    marks = tmp_path / "marks.txt"
    (user / "sitecustomize.py").write_text(
        f"import os, sys\nopen({str(marks)!r}, 'a').write(os.path.basename(sys.argv[0]) + '\\n')\n")
    out = tmp_path / "run"
    pythonpath = os.pathsep.join(p for p in (str(user), os.environ.get("PYTHONPATH")) if p)
    p = amp("run", "--out", out, SCRIPT, env={"PYTHONPATH": pythonpath})
    assert p.returncode == 0, p.stdout + p.stderr
    meta0, steps0 = _steps(out / "trace.sqlite")
    meta1, steps1 = _steps(out / "trace.rank1.sqlite")  # (was missing: rank 1 ran without ampdoctor)
    assert (meta0["rank"], meta1["rank"]) == (0, 1) and meta0["status"] == meta1["status"] == "finished"
    assert steps0 == steps1 == set(range(8))
    # the user's own sitecustomize still ran in rank 1's process, after ours (which shadows it on the path)
    assert "self_launched_ddp.py" in marks.read_text().split(), marks.read_text()


def test_bisect_forces_the_layers_in_a_self_launched_rank_too(tmp_path):
    out = tmp_path / "b"
    p = amp("bisect", "--out", out, "--json", tmp_path / "b.json", SCRIPT, "--", "--overflow")
    res = json.loads((tmp_path / "b.json").read_text())
    assert res["verdict"] == "culprit" and res["culprits"] == ["1"], p.stdout + p.stderr
    trial = next(d for d in sorted((out / "trials").iterdir()) if d.name.endswith("-1"))
    for name in ("trace.sqlite", "trace.rank1.sqlite"):
        r = TraceReader(trial / name)
        ids = {layer["name"]: layer["id"] for layer in r.layers()}
        dtypes = {s["dtype"] for s in r.stats(kind="activation") if s["layer"] == ids["1"]}
        assert dtypes == {"float32"}, (name, dtypes)


def test_run_script_leaves_the_environment_as_it_was(tmp_path, monkeypatch):
    from ampdoctor.config import RunConfig
    from ampdoctor.runner import run_script

    for k in ("PYTHONPATH", rank_boot.SCRIPT_VAR, rank_boot.PARENT_VAR, rank_boot.SAVED_VAR):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    before = dict(os.environ)
    seen = tmp_path / "seen.json"
    script = tmp_path / "s.py"
    script.write_text(f"import json, os\njson.dump(dict(os.environ), open({str(seen)!r}, 'w'))\n")
    res = run_script(script, [], RunConfig(trace=str(tmp_path / "t.sqlite")))
    assert res.status == "finished", res
    assert dict(os.environ) == before
    during = json.loads(seen.read_text())  # what a process the script starts inherits
    assert during["PYTHONPATH"].split(os.pathsep) == [rank_boot.BOOT, "/somewhere"]
    assert during[rank_boot.SCRIPT_VAR] == str(script.resolve()) and during[rank_boot.SAVED_VAR] == "/somewhere"


def test_other_processes_started_meanwhile_are_left_alone(tmp_path):
    """The boot's sitecustomize in a process that is not such a rank (a helper run as a script, the
    same file without LOCAL_RANK): it runs normally, with PYTHONPATH and sys.path as they were."""
    probe = tmp_path / "probe.py"
    probe.write_text("import json, os, sys\nprint(json.dumps([os.environ.get('PYTHONPATH'), sys.path, "
                     "'ampdoctor' in sys.modules]))\n")
    env = dict(os.environ, PYTHONPATH=rank_boot.BOOT + os.pathsep + "/somewhere", AMPDOCTOR_CONFIG="{}",
               **{rank_boot.SCRIPT_VAR: str(probe.resolve()), rank_boot.PARENT_VAR: "1",
                  rank_boot.SAVED_VAR: "/somewhere"})
    env.pop("LOCAL_RANK", None)
    env.pop("RANK", None)
    p = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    pythonpath, path, imported = json.loads(p.stdout)
    assert pythonpath == "/somewhere" and rank_boot.BOOT not in path and "/somewhere" in path
    assert not imported  # (no session, no watch: the script ran as without ampdoctor)


def test_the_boot_reads_the_names_rank_boot_sets():
    boot = (Path(rank_boot.BOOT) / "sitecustomize.py").read_text()
    for name in (rank_boot.SCRIPT_VAR, rank_boot.PARENT_VAR, rank_boot.SAVED_VAR, rank_boot.UNSET):
        assert f'"{name}"' in boot, name
