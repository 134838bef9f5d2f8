"""Processes forked from one that records (``multiprocessing`` with the fork start method, DataLoader
workers), and scripts that end with ``os._exit``: a forked child does not write into its parent's
trace, a ``watch()`` in it records a trace of its own, and ``os._exit`` does not lose a watch's rows."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ampdoctor.trace import TraceReader

ROOT = Path(__file__).parent.parent

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")

_COMMON = """
import json, multiprocessing as mp, os, sys
import torch
import ampdoctor
torch.set_num_threads(1)

def train(model, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        model(torch.randn(2, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
"""


def _python(code, tmp_path, timeout=120):
    script = tmp_path / "script.py"
    script.write_text(_COMMON + textwrap.dedent(code))
    env = dict(os.environ)
    env.pop("AMPDOCTOR_CONFIG", None)
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, env=env,
                       timeout=timeout)
    assert p.returncode == 0, p.stderr
    return p


def test_a_watch_in_a_forked_child_records_its_own_trace(tmp_path):
    # The child's watch() used to join the session it inherited, whose writer belongs to the parent: its
    # three steps went nowhere, silently.
    _python("""
        def child(path):
            m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
            ampdoctor.watch(m, trace=path)   # never removed: the fork start method ends the child with os._exit
            train(m, 3)

        if __name__ == "__main__":
            parent = torch.nn.Linear(4, 1)
            w = ampdoctor.watch(parent, trace="parent.sqlite")
            train(parent, 2)
            p = mp.get_context("fork").Process(target=child, args=("child.sqlite",))
            p.start()
            p.join()
            assert p.exitcode == 0
            train(parent, 1)
            w.remove()
        """, tmp_path)
    child = TraceReader(tmp_path / "child.sqlite")
    assert len(child.steps()) == 3
    assert {r["name"] for r in child.layers()} >= {"0", "1", "2"}
    assert child.meta()["pid"] != TraceReader(tmp_path / "parent.sqlite").meta()["pid"]
    parent = TraceReader(tmp_path / "parent.sqlite")
    assert len(parent.steps()) == 3  # its own 2 + 1, none of the child's


def test_a_forked_child_that_trains_the_watched_model_leaves_the_parents_trace_alone(tmp_path):
    p = _python("""
        def child(model, q):
            hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
            train(model, 3)
            q.put((hooks, torch.autograd.backward.__module__, torch.optim.Optimizer.step.__qualname__))

        if __name__ == "__main__":
            m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
            before = torch.autograd.backward
            w = ampdoctor.watch(m, trace="parent.sqlite")
            train(m, 2)
            ctx = mp.get_context("fork")
            q = ctx.Queue()
            p = ctx.Process(target=child, args=(m, q))
            p.start()
            got = q.get(timeout=60)
            p.join()
            train(m, 1)
            w.remove()
            print(json.dumps({"child": got, "exit": p.exitcode, "before": before.__module__}))
        """, tmp_path)
    got = json.loads(_last_line(p.stdout))
    hooks, backward_module, step_name = got["child"]
    assert got["exit"] == 0
    assert hooks == 0  # the watch's hooks are out of the child's copy of the model
    assert backward_module == got["before"]  # torch.autograd.backward is torch's own again in the child
    assert step_name == "Optimizer.step" or "wrapper" not in step_name
    parent = TraceReader(tmp_path / "parent.sqlite")
    assert len(parent.steps()) == 3  # 2 + 1 of the parent's, none of the child's 3
    assert parent.meta()["status"] == "finished"


def test_os_exit_ends_a_watch_never_removed_with_every_step_kept(tmp_path):
    # os._exit skips atexit, which ends such a watch's trace otherwise: its queued rows were lost.
    _python("""
        if __name__ == "__main__":
            m = torch.nn.Linear(4, 1)
            ampdoctor.watch(m, trace="t.sqlite")
            train(m, 4)
            sys.stdout.flush()
            os._exit(0)
        """, tmp_path)
    t = TraceReader(tmp_path / "t.sqlite")
    assert len(t.steps()) == 4
    assert t.meta()["status"] == "finished"
    assert any(r["kind"] == "activation" for r in t.stats())


def test_os_exit_is_its_own_again_after_remove(tmp_path):
    p = _python("""
        if __name__ == "__main__":
            real = os._exit
            w = ampdoctor.watch(torch.nn.Linear(4, 1), trace="t.sqlite")
            patched = os._exit is not real
            w.remove()
            print(json.dumps([patched, os._exit is real]))
        """, tmp_path)
    assert json.loads(_last_line(p.stdout)) == [True, True]


def test_the_trace_writer_process_ends_quietly_when_its_sender_is_gone(tmp_path):
    import ampdoctor
    import ampdoctor.trace as trace_mod
    from ampdoctor.trace import TraceWriter

    w = TraceWriter(tmp_path / "t.sqlite")  # makes the schema
    w.close()
    r, wr = os.pipe()
    os.close(r)  # the training process ended before the writer said it is ready
    try:
        p = subprocess.run([sys.executable, str(Path(ampdoctor.__file__).parent / "_trace_child.py"),
                            str(tmp_path / "t.sqlite"), trace_mod.__file__],
                           stdin=subprocess.DEVNULL, stdout=wr, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(wr)
    assert p.returncode == 0 and p.stderr == "", p.stderr


def _last_line(text):
    return [ln for ln in text.splitlines() if ln.strip()][-1]


_OS_FORK = """
import os, sys
import torch
import ampdoctor
torch.set_num_threads(1)
m = torch.nn.Linear(4, 1)
ampdoctor.watch(m)
opt = torch.optim.SGD(m.parameters(), lr=0.01)
def train(n):
    for _ in range(n):
        m(torch.randn(2, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
train(2)
pid = os.fork()
if pid == 0:
    train(3)
    print("child done", flush=True)
    if sys.argv[1] == "raise":
        raise ValueError("the child's own error")
    sys.exit(0)
_, status = os.waitpid(pid, 0)
print("child status", os.waitstatus_to_exitcode(status), flush=True)
train(1)
"""


@pytest.mark.parametrize("how, child_status", [("exit", 0), ("raise", 1)])
def test_a_child_forked_by_the_script_under_run_ends_as_itself(tmp_path, how, child_status):
    # the child came back out of the script into the CLI and ended the run a second time: a report of
    # the steps before the fork printed, and written into the run folder, over the parent's
    script = tmp_path / "forks.py"
    script.write_text(_OS_FORK)
    env = dict(os.environ)
    env.pop("AMPDOCTOR_CONFIG", None)
    p = subprocess.run([sys.executable, "-m", "ampdoctor", "run", "--out", str(tmp_path / "out"), str(script), how],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "child done" in p.stdout and f"child status {child_status}" in p.stdout
    assert p.stdout.count("Diagnosis") == 1, p.stdout
    assert p.stdout.count("run folder: ") == 1
    if how == "raise":
        assert "ValueError: the child's own error" in p.stderr and "forks.py" in p.stderr
    assert len(TraceReader(tmp_path / "out" / "trace.sqlite").steps()) == 3  # the parent's 2 + 1
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert len(report["timeline"]) == 3
