"""The run configuration that `ampdoctor run`/`bisect` hand to the watched process.

It travels as JSON in the environment variable :data:`ENV_VAR`, so a ``watch(model)`` call in
the user's script (or the automatic watch) picks up the trial's settings: which modules to force
to FP32, the step budget, where the trace goes, and the oracle's criteria.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

ENV_VAR = "AMPDOCTOR_CONFIG"


@dataclass
class RunConfig:
    trace: str | None = None          # trace file to write (one per rank: ``.rankN`` added for N > 0)
    format: str = "auto"              # target format the statistics are measured against ("auto": formats.detect_format)
    every: int = 1                    # record full statistics every N steps
    all_modules: bool = False         # statistics for containers too, not only leaves
    max_steps: int | None = None      # stop the script cleanly after N steps
    force_fp32: list[str] = field(default_factory=list)  # qualified module names run in FP32
    oracle: dict[str, Any] | None = None  # OracleConfig as a dict: decide fail/pass per step
    pass_after: int | None = None     # a trial passes once this many steps ran without failing
    auto_watch: bool = True           # watch the model automatically if the script never calls watch()
    probe: list[str] = field(default_factory=list)  # modules to drill into op by op
    reference_losses: dict[str, float] | None = None  # FP32 control's loss per step (divergence)
    autocast_off: bool = False        # every torch.autocast region of the script entered disabled (bisect's control)

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls, environ: dict | None = None) -> RunConfig | None:
        raw = (environ if environ is not None else os.environ).get(ENV_VAR)
        if not raw:
            return None
        data = json.loads(raw)
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)
