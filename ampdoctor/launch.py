"""Launching a script through torchrun: one ``ampdoctor._trial`` process per rank, each writing
its own trace (``trace.rankN.sqlite``) and result (``result.rankN.json``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Sequence


def torchrun_command(nproc: int, script: str, args: Sequence[str], python: str | None = None) -> list[str]:
    return [python or sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "ampdoctor._trial", script, *args]


RESULT_PATTERN = "result.rank{rank}.json"  # _trial fills in RANK


def read_rank_results(folder: Path) -> dict[int, dict]:
    out = {}
    for p in sorted(Path(folder).glob("result.rank*.json")):
        try:
            data = json.loads(p.read_text())
        except ValueError:
            continue
        out[int(data.get("rank", 0))] = data
    return out
