"""Decide whether a trial run *fails* or *passes*, from per-step observations.

Plain Python, no torch: the watch layer feeds :meth:`Oracle.observe` once per optimizer
step with what it saw (loss, GradScaler scale, whether the step was skipped, whether all
parameters are finite) and stops the trial as soon as a failing :class:`Decision` comes
back. :meth:`Oracle.finish` gives the verdict of a run that reached its end.

Criteria, each reported as a ``reason``:

``nonfinite_loss``
    the loss is NaN/Inf in ``nonfinite_k`` consecutive observed steps (one bad batch that
    the GradScaler skips is not a failure);
``nonfinite_params``
    any parameter (or optimizer state) is non-finite: training cannot recover from that. A session
    with an oracle checks the parameters at every step (a search trial's unrecorded steps too, see
    ``Session._params_screen``). Where they were not checked at every step (``params_finite`` None
    in between), the step reported is the first of the non-finite loss streak that led there, if
    one began after the last step whose parameters were seen finite: the update that broke them is
    no later than that;
``scale_collapse``
    the GradScaler scale fell below ``scale_floor``;
``skipped_steps``
    more than ``skip_frac`` of the last ``skip_window`` optimizer steps were skipped, after
    the scaler's start-up (see ``startup_grace``); more than ``startup_grace`` skips in a row from
    the first step unless the scale halved at each of them (a huge ``init_scale`` backing off: a
    failure only if the run ends, or the trial is decided, before a step is taken; a scale that
    keeps falling collapses first); or a run that ends with every one of its
    steps (at least :data:`NAN_SKIPS`) skipped, whose recorded gradients held NaN but no Inf
    (``grads="nan"``): not start-up backoffs, which come from a scale too high and overflow
    to Inf;
``divergence``
    with a reference (FP32 control) loss curve, the final loss is above ``divergence``
    times the reference loss; or, with ``blowup`` (bisect sets it for its all-FP32 control), the
    loss of each of the last ``divergence_window`` steps is above ``blowup`` times its average
    over the first ``divergence_window`` steps (one bad batch is not enough): a run that diverges
    in any precision (a learning rate too high) whose loss has not yet turned non-finite in FP32.

The step reported is the first step of the failing streak or window, i.e. where things
broke, not where the oracle became sure.
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional, Sequence

__all__ = ["OracleConfig", "Decision", "Oracle", "REASONS"]

REASONS = ("nonfinite_loss", "nonfinite_params", "scale_collapse", "skipped_steps", "divergence")
# a run whose every step was skipped, at least this many, with NaN-only gradients, failed (see
# ``skipped_steps``); fewer could be a start-up backoff whose Inf an op inside a layer turned into NaN
NAN_SKIPS = 4
GRADS = (None, "finite", "nan", "inf")  # Oracle.observe's ``grads``: what a recorded step's gradients held


@dataclass
class OracleConfig:
    """Thresholds of the oracle. JSON-able: :meth:`to_json` travels in an environment variable."""

    # Loss NaN/Inf in this many consecutive observed steps -> fail. 3 tolerates the odd bad
    # batch (a GradScaler skips it) but catches a run that stays broken.
    nonfinite_k: int = 3
    # GradScaler scale below this -> scale_collapse. At scale 1 the scaler no longer
    # magnifies gradients; below it, it shrinks them because even unscaled gradients
    # overflow. DeepSpeed and Megatron-LM stop at a minimum loss scale of 1 for the same
    # reason. Healthy fp16 runs settle at 2**10..2**24; bf16 needs no scaler (scale stays 1.0,
    # which is not below the floor).
    scale_floor: float = 1.0
    # Skipped-step window: fail when more than skip_frac * skip_window of the last
    # skip_window steps (after start-up) were skipped. A healthy scaler skips one step per
    # growth_interval (2000 by default), far below half.
    skip_window: int = 10
    skip_frac: float = 0.5
    # Skipped steps before the first successful optimizer step are the scaler's start-up
    # backoffs (init_scale 65536 halves until gradients fit; 3-5 skips are normal) and do not
    # count; more than this many in a row from the start is a failure. 20 is generous:
    # 65536 / 2**16 is already 1, where scale_collapse trips anyway. A longer run whose scale fell
    # at every skip is a larger init_scale (2**40 skips ~24 steps) still backing off: it fails
    # only if no step is taken before the run ends (or the scale collapses).
    startup_grace: int = 20
    # With reference losses: fail when the final loss exceeds this factor times the
    # reference (None: not judged). Both sides are averaged over the last
    # divergence_window steps they share, to be robust to batch noise.
    divergence: Optional[float] = None
    divergence_window: int = 5
    # Fail (divergence) when the loss of divergence_window steps in a row is above this factor
    # times its average over the first divergence_window steps (None: not judged; judged only for
    # a positive start). Healthy training does not stay 100x above its initial loss.
    blowup: Optional[float] = None

    def __post_init__(self) -> None:
        problems = []
        if int(self.nonfinite_k) < 1:
            problems.append(f"nonfinite_k={self.nonfinite_k} (must be >= 1)")
        if not self.scale_floor >= 0:
            problems.append(f"scale_floor={self.scale_floor} (must be >= 0)")
        if int(self.skip_window) < 1:
            problems.append(f"skip_window={self.skip_window} (must be >= 1)")
        if not 0 < self.skip_frac <= 1:
            problems.append(f"skip_frac={self.skip_frac} (must be in (0, 1])")
        if int(self.startup_grace) < 0:
            problems.append(f"startup_grace={self.startup_grace} (must be >= 0)")
        if self.divergence is not None and not self.divergence > 0:
            problems.append(f"divergence={self.divergence} (must be > 0 or None)")
        if self.blowup is not None and not self.blowup > 1:
            problems.append(f"blowup={self.blowup} (must be > 1 or None)")
        if int(self.divergence_window) < 1:
            problems.append(f"divergence_window={self.divergence_window} (must be >= 1)")
        if problems:
            raise ValueError("invalid OracleConfig: " + "; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OracleConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown OracleConfig keys {unknown}; known keys: {sorted(known)}")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> OracleConfig:
        return cls.from_dict(json.loads(text))


@dataclass
class Decision:
    """``outcome`` is ``"fail"`` or ``"pass"``; ``reason`` is one of :data:`REASONS` (fails only)."""

    outcome: str
    step: Optional[int] = None
    reason: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def trailing_nonfinite_start(losses: Sequence[tuple[int, Optional[float]]]) -> Optional[int]:
    """The first step of the non-finite streak a run *ended* in (shorter than ``nonfinite_k`` is
    enough: nothing came after it), or None when the last loss seen is finite or there is none.
    ``losses`` is ``(step, loss)`` in step order; unobserved losses (None) end the search."""
    start = None
    for step, loss in reversed(list(losses)):
        if loss is None or math.isfinite(loss):
            break
        start = step
    return start


class Oracle:
    """Feed it one observation per step; it says ``fail`` the moment a criterion trips."""

    def __init__(self, cfg: Optional[OracleConfig] = None,
                 reference_losses: Optional[dict[int, float]] = None) -> None:
        self.cfg = cfg if cfg is not None else OracleConfig()
        self.reference = {int(k): float(v) for k, v in (reference_losses or {}).items()}
        self.decision: Optional[Decision] = None
        self.losses: dict[int, float] = {}
        self.last_step: Optional[int] = None
        self._nonfinite_start: Optional[int] = None
        self._nonfinite_run = 0
        self._params_ok: Optional[int] = None  # the last step whose parameters were seen finite
        self._warmed_up = False  # a non-skipped optimizer step has happened
        self._startup_skips: list[int] = []
        self._startup_scale: Optional[float] = None  # the scale after the last start-up skip
        self._startup_falling = True  # the scale fell at every start-up skip (a backoff from init_scale)
        self._window: deque[tuple[int, bool]] = deque(maxlen=self.cfg.skip_window)
        self._backoff_start: Optional[int] = None  # first step of the current run of scale drops
        self._last_scale: Optional[float] = None
        self._observed = 0  # steps observed
        self._first_losses: list[float] = []  # the first divergence_window finite losses (blowup's base)
        self._recent: deque[tuple[int, float]] = deque(maxlen=self.cfg.divergence_window)  # the last losses
        self._grads: set[str] = set()  # what the recorded steps' gradients held ("finite", "nan", "inf")
        self._last_skipped = False  # the last step observed was skipped by the GradScaler

    def observe(self, step: int, loss: Optional[float] = None, scale: Optional[float] = None,
                skipped: Optional[bool] = None, params_finite: Optional[bool] = None,
                grads: Optional[str] = None) -> Optional[Decision]:
        """Record one step; returns the failing :class:`Decision` once one trips (and the same
        decision on later calls), else ``None``. ``None`` arguments mean "not observed".
        ``grads``: what the step's recorded gradients held: ``"finite"``, ``"nan"`` (NaN, and no
        Inf), ``"inf"`` (an Inf)."""
        if self.decision is not None:
            return self.decision
        if grads not in GRADS:
            raise ValueError(f"grads={grads!r}; expected one of {GRADS}")
        self.last_step = step
        self._observed += 1
        if skipped is not None:
            self._last_skipped = bool(skipped)
        if grads is not None:
            self._grads.add(grads)
        if loss is not None:
            self.losses[step] = float(loss)
        for check in (self._check_params, self._check_loss, self._check_scale, self._check_skips, self._check_blowup):
            fail = check(step, loss, scale, skipped, params_finite)
            if fail is not None:
                self.decision = fail
                return fail
        return None

    def finish(self) -> Decision:
        """The verdict at the end of the run: the failure if one tripped, else divergence is
        judged (when configured), else pass."""
        if self.decision is not None:
            return self.decision
        if self.nan_skips() or (not self._warmed_up and len(self._startup_skips) > self.cfg.startup_grace):
            # (the second: a long backoff from a huge init_scale that never reached a scale that fits)
            self.decision = Decision("fail", self._startup_skips[0], "skipped_steps")
            return self.decision
        div = self._check_divergence()
        if div is not None:
            self.decision = div
            return div
        return Decision("pass", self.last_step, None)

    def settled(self) -> bool:
        """Whether a trial may be judged now, at its horizon: no non-finite loss streak is in progress
        (one shorter than ``nonfinite_k`` that the next steps may carry to a failure) and the last
        step observed was not skipped. Judged while a NaN streak ran, a trial passed although its last
        losses were NaN; waiting is bounded, since each such streak ends or fails within
        ``nonfinite_k`` steps, and skips that persist fail the skip window."""
        return self._nonfinite_run == 0 and not self._last_skipped

    def nan_skips(self) -> bool:
        """Every step observed so far (at least :data:`NAN_SKIPS`) was skipped with a finite loss, and
        the recorded gradients held NaN but never Inf: a failure once the run ends so (see
        ``skipped_steps``)."""
        return (not self._warmed_up and self._observed >= NAN_SKIPS and len(self._startup_skips) == self._observed
                and all(math.isfinite(v) for v in self.losses.values())
                and "nan" in self._grads and "inf" not in self._grads)

    # -- criteria -----------------------------------------------------------------------
    def _check_params(self, step, loss, scale, skipped, params_finite) -> Optional[Decision]:
        if params_finite is True:
            self._params_ok = step
        if params_finite is False:
            start = step
            if self._nonfinite_start is not None and (self._params_ok is None or self._nonfinite_start > self._params_ok):
                # unchecked since: the loss went non-finite first (a checked run saw the weights break there)
                start = self._nonfinite_start
            return Decision("fail", start, "nonfinite_params")
        return None

    def _check_loss(self, step, loss, scale, skipped, params_finite) -> Optional[Decision]:
        if loss is None:
            return None  # unobserved: neither extends nor breaks the streak
        if math.isfinite(loss):
            self._nonfinite_run, self._nonfinite_start = 0, None
            return None
        if self._nonfinite_run == 0:
            self._nonfinite_start = step
        self._nonfinite_run += 1
        if self._nonfinite_run >= self.cfg.nonfinite_k:
            return Decision("fail", self._nonfinite_start, "nonfinite_loss")
        return None

    def _check_scale(self, step, loss, scale, skipped, params_finite) -> Optional[Decision]:
        if scale is None:
            return None
        dropped = self._last_scale is not None and scale < self._last_scale
        if dropped or skipped:
            if self._backoff_start is None:
                self._backoff_start = step
        else:
            self._backoff_start = None
        self._last_scale = scale
        if scale < self.cfg.scale_floor or not math.isfinite(scale):
            start = self._backoff_start if self._backoff_start is not None else step
            return Decision("fail", start, "scale_collapse")
        return None

    def _check_skips(self, step, loss, scale, skipped, params_finite) -> Optional[Decision]:
        if skipped is None:
            return None
        if not self._warmed_up:
            if not skipped:
                self._warmed_up = True
                return None
            self._startup_skips.append(step)
            falling = scale is not None and (self._startup_scale is None or scale < self._startup_scale)
            self._startup_falling = self._startup_falling and falling
            self._startup_scale = scale
            if len(self._startup_skips) > self.cfg.startup_grace and not self._startup_falling:
                return Decision("fail", self._startup_skips[0], "skipped_steps")
            return None
        self._window.append((step, bool(skipped)))
        skips = [s for s, sk in self._window if sk]
        if len(skips) > self.cfg.skip_frac * self.cfg.skip_window:
            return Decision("fail", skips[0], "skipped_steps")
        return None

    def _check_blowup(self, step, loss, scale, skipped, params_finite) -> Optional[Decision]:
        factor, window = self.cfg.blowup, self.cfg.divergence_window
        if factor is None or loss is None:
            return None
        if len(self._first_losses) < window:
            if math.isfinite(loss):
                self._first_losses.append(float(loss))
            return None
        self._recent.append((step, float(loss)))
        base = sum(self._first_losses) / window
        if base <= 0 or len(self._recent) < window or not all(math.isfinite(v) for _, v in self._recent):
            return None  # (a non-finite loss is nonfinite_loss's)
        if min(v for _, v in self._recent) <= factor * base:
            return None
        # where it broke: the start of the trailing run of steps above the threshold
        start = step
        for s in sorted(self.losses, reverse=True):
            v = self.losses[s]
            if math.isfinite(v) and v <= factor * base:
                break
            start = s
        return Decision("fail", start, "divergence")

    def _check_divergence(self) -> Optional[Decision]:
        factor = self.cfg.divergence
        if factor is None or not self.reference or not self.losses:
            return None
        shared = sorted(s for s in self.losses if s in self.reference)
        if not shared:
            return None
        tail = shared[-self.cfg.divergence_window:]
        final = sum(self.losses[s] for s in tail) / len(tail)
        ref = sum(self.reference[s] for s in tail) / len(tail)
        if math.isnan(final) or self._above(final, ref, factor):
            # Where it broke: the start of the trailing run of steps that are above the reference.
            start = shared[-1]
            for s in reversed(shared):
                if not self._above(self.losses[s], self.reference[s], factor):
                    break
                start = s
            return Decision("fail", start, "divergence")
        return None

    @staticmethod
    def _above(loss: float, ref: float, factor: float) -> bool:
        if math.isnan(loss):
            return True
        # loss > factor * ref for positive losses; (factor - 1) * |ref| above for any sign.
        return loss - ref > (factor - 1.0) * abs(ref)
