"""Entry point of one bisect trial: ``python -m ampdoctor._trial SCRIPT [ARGS...]``.

The trial's :class:`~ampdoctor.config.RunConfig` comes in ``AMPDOCTOR_CONFIG``; the result
goes as JSON to the file named by ``AMPDOCTOR_TRIAL_RESULT``. A fresh process per trial gives
clean CUDA/RNG/global state, and a hung trial can be killed.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from .config import RunConfig
    from .runner import ScriptNotFound, run_script

    cfg = RunConfig.from_env()
    out = os.environ.get("AMPDOCTOR_TRIAL_RESULT")
    if cfg is None or not out or not argv:
        print("ampdoctor._trial is started by `ampdoctor bisect`/`run --nproc-per-node`, not by hand", file=sys.stderr)
        return 2

    def record(res: Any) -> dict:
        if res.traceback:  # as Python would print it: the trial's stderr.txt, which bisect points to, holds it
            sys.stderr.write(res.traceback)
        data = {
            "status": res.status, "exit_code": res.exit_code, "error": res.error, "traceback": res.traceback,
            "steps": res.steps, "optimizer_steps": res.optimizer_steps, "trained": res.trained,
            "stop_reason": res.stop_reason, "trace": res.trace,
            "decision": None if res.decision is None else {
                "outcome": res.decision.outcome, "step": res.decision.step, "reason": res.decision.reason},
        }
        _write(out, data)
        return data

    try:
        # (a script that ends with os._exit() gets its result written on the way out)
        data = record(run_script(argv[0], argv[1:], cfg, on_hard_exit=record))
    except ScriptNotFound as e:
        data = _write(out, {"status": "crashed", "exit_code": 2, "error": str(e), "steps": 0, "trained": False})
    sys.stdout.flush()
    sys.stderr.flush()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and data.get("status") == "stopped":
        if data["rank"] != 0:  # rank 0 speaks for the run: let it write its result before torchrun stops it
            _wait_for(os.environ["AMPDOCTOR_TRIAL_RESULT"].replace("{rank}", "0"), RANK0_GRACE)
        return STOPPED_UNDER_TORCHRUN  # non-zero: torchrun then stops the other ranks too
    return 0


def _write(out: str, data: dict) -> dict:
    """The trial's result, for rank ``RANK`` (``{rank}`` in ``out``), written atomically."""
    rank = os.environ.get("RANK", "0")
    data["rank"] = int(rank) if rank.isdigit() else 0
    path = out.replace("{rank}", rank)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)
    return data


def _wait_for(path: str, seconds: float) -> None:
    import time
    end = time.monotonic() + seconds
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.05)


STOPPED_UNDER_TORCHRUN = 75
RANK0_GRACE = 3.0  # seconds a rank that stopped first waits for rank 0's result

if __name__ == "__main__":
    # os._exit: skip interpreter teardown of the user's objects (atexit already ran in run_script's close)
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
