"""The bisect procedure: controls, the stats-guided search, the drill-down, the result.

``run_bisect`` returns the contract's JSON (see DESIGN.md) and writes it to ``out/bisect.json``.
Progress goes to a callback (the CLI prints it); nothing here prints.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from ..naming import half_weights_under, is_torch_module, module_expr, plain_fix, root_hint, wrapped_hint
from ..oracle import OracleConfig
from ..report.culprit import CAME_IN, LOSS_OVERFLOW, OUTSIDE_MODEL, OWN_CODE, recomputed_note
from ..trace import TraceReader
from .candidates import Baseline, read_baseline
from .search import find_culprits
from .trials import Trial, TrialRunner

log = logging.getLogger(__name__)

VERDICT_EXIT = {"culprit": 0, "healthy": 0, "error": 1, "not_precision": 3, "inconclusive": 4}
# The all-FP32 control runs this many times as far as the other trials (pass_after): a run that diverges
# in any precision (a learning rate too high) often breaks later in FP32 than in fp16, and a control that
# passed at the failure step + margin made it look like precision's fault.
CONTROL_HORIZON = 2
# ... and fails (divergence) once its loss grows above this many times its first steps' (OracleConfig.blowup):
# a diverging FP32 run is caught before its loss turns non-finite, however far away that is.
CONTROL_BLOWUP = 100.0


@dataclass
class BisectOptions:
    fmt: str = "auto"  # "auto": what the baseline trains in, then that for every later trial
    oracle: OracleConfig | None = None
    timeout: float | None = None      # per trial (seconds); default: none for the baseline, then 3x its time + 30 s (at least 60)
    max_steps: int | None = None      # cap every trial (the baseline too)
    margin: int | None = None         # a trial passes after the failure step + margin steps
    jobs: int = 1
    repeat: int = 1
    drill: bool = True
    max_trials: int | None = None
    divergence: float | None = None
    use_hints: bool = True            # try the layer the baseline trace blames first
    nproc: int = 1                    # launch every trial through torchrun with this many ranks
    fork: bool = False                # fork trials from this process (only if it never ran a torch op)
    control_blowup: float | None = CONTROL_BLOWUP  # the all-FP32 control fails when its loss grows this much


def _gpus() -> int:
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def _ops_from(trace: Path, culprits: Sequence[str]) -> list[dict]:
    ops: list[dict] = []
    try:
        with TraceReader(trace) as r:
            events = r.events("op")
    except Exception:
        return ops
    inside = [e for e in events if any(e["layer"] == c or e["layer"].startswith(c + ".") or c == "" for c in culprits)]
    for pick in ("first", "worst", "worst_backward"):
        for e in inside:
            d = e["detail"]
            if d.get("pick") != pick:
                continue
            recomputed = d.get("absmax_fp32") is not None
            absmax = d.get("absmax_fp32") if recomputed else d.get("absmax")
            if d.get("nonfinite") and not recomputed:
                absmax = math.inf
            item = {"layer": e["layer"], "op": d.get("op"), "where": d.get("where"), "absmax": absmax,
                    "phase": d.get("phase", "forward"), "nonfinite": bool(d.get("nonfinite")), "step": e["step"],
                    "pick": pick, "dtype": d.get("dtype"),
                    # a non-finite low-precision output has no abs-max of its own: "fp32_recompute" says the
                    # abs-max is of the same op recomputed in FP32 (what it would have produced), not of `dtype`
                    "absmax_of": "fp32_recompute" if recomputed else "output"}
            src = _source_line(d.get("path"), d.get("where"))
            if src:
                item["source"] = src  # the text of the line `where` names
            if d.get("passthrough") and item["phase"] == "backward":
                item["came_in"] = True  # its gradient was already non-finite where it left the culprit
            if not any(o["op"] == item["op"] and o["where"] == item["where"] and o["phase"] == item["phase"] for o in ops):
                ops.append(item)
    return ops


def _source_line(path: Any, where: Any) -> str:
    """The text of the source line ``where`` (``file.py:42``, or a notebook cell's ``cell In[5], line 7``)
    names in file ``path`` ("" if unreadable: a cell's code is in ``linecache`` while its shell runs)."""
    if not path or not isinstance(where, str):
        return ""
    line = where.rsplit(", line ", 1)[1] if where.startswith("cell ") and ", line " in where else where.rsplit(":", 1)[-1]
    if not line.isdigit():
        return ""
    import linecache

    return linecache.getline(str(path), int(line)).strip()[:200]


def _scaled_after(src: str) -> bool:
    """Whether source line ``src`` scales a product after making it (``q @ k.T * s``, ``matmul(q, k) / s``)."""
    code = src.split("#", 1)[0]
    at = [i for i in (code.find("@"), code.find("matmul("), code.find("bmm(")) if i >= 0]
    if not at:
        return False
    rest = code[min(at):]
    depth = 0
    for ch in rest:  # a * or / outside the brackets the product's own arguments open
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif ch in "*/" and depth <= 0:
            return True
    return False


def _came_in_too_large(trace: Path, culprits: Sequence[str], fmt: str) -> list[str]:
    """Advice for a culprit whose input already held values beyond the format's max when it was
    called in the drill-down (the probe's ``probe_input`` events): the values grew before it."""
    try:
        with TraceReader(trace) as r:
            events = r.events("probe_input")
    except Exception:
        return []
    out = []
    for c in culprits:
        e = next((e for e in events if e["layer"] == c), None)
        if e is None:
            continue
        absmax = e["detail"].get("absmax")
        held = f"abs-max {_fmt(absmax)}" if absmax is not None else "NaN/Inf"
        first = e["detail"].get("first_step")
        since = f", step {e['step']}" if first is None or first == e["step"] else \
            f" at step {e['step']}; beyond it from step {first}"
        out.append(f"{CAME_IN}{c or 'the model'} was already beyond {fmt}'s max when it was called ({held}{since}): "
                   "the values grow before it, in the code that feeds it. Keeping it in FP32 works "
                   "around that; scaling or normalising its input where it is computed removes the cause.")
    return out


def _drill_name(layer: str) -> str:
    """The trial folder's name of a drill-down probing ``layer`` alone."""
    return ("drill-down-" + (layer or "root"))[:60].replace("/", "_")


def _own_code_root(bl: Baseline, culprits: Sequence[str]) -> str | None:
    """The root module (the model, or a second one) whose own forward code, outside its submodules, made the
    baseline's first NaN/Inf, where no culprit is that root: a layer whose FP32 output feeds that code was found
    instead (its output in FP32 makes the code run in FP32)."""
    first = bl.first_nonfinite or {}
    layer = first.get("layer")
    if first.get("kind") != "activation" or first.get("input_nonfinite") or first.get("at_start") or layer is None:
        return None
    is_root = layer in bl.parent and bl.parent[layer] is None
    return layer if is_root and layer not in culprits else None


def own_code_advice(bl: Baseline, root: str | None, culprits: Sequence[str], ops: list[dict]) -> list[str]:
    """What to say where :func:`_own_code_root` found one: the code is the cause, the culprits a workaround."""
    if root is None:
        return []
    cls = bl.types.get(root) or "the model"
    first = bl.first_nonfinite or {}
    where = (f" (`{ops[0]['op']}` at {ops[0]['where']}" + (f": `{ops[0]['source']}`" if ops[0].get("source") else "")
             + ")") if ops else ""
    names = ", ".join(c or "the whole model" for c in culprits)
    return [f"{OWN_CODE}{cls}.forward's own code{where}, outside its submodules, at step {first.get('step')}: keeping "
            f"{names} in FP32 passes because {'its' if len(culprits) == 1 else 'their'} FP32 output makes that code "
            "run in FP32 too. Running that code in FP32 instead (its inputs `.float()`, under "
            "`torch.autocast(x.device.type, enabled=False)`), or keeping its values in range, fixes the cause."]


def loss_advice(first: dict | None, culprits: Sequence[str]) -> list[str]:
    """Where the baseline's first non-finite value was made by the loss (the gradient entering the model
    from it, no layer producing it): computing the loss in FP32 is the fix; a culprit that is the layer
    the loss reads (or holds it) passes only because its FP32 output makes the loss run in FP32."""
    if not first or not first.get("from_loss"):
        return []
    layer = first.get("layer") or ""
    what = (f"the loss was already non-finite at step {first.get('step')} while every watched layer's output was "
            "finite" if first.get("loss_nonfinite") else
            f"the gradient entering {layer or 'the model'} from the loss was non-finite at step {first.get('step')} "
            "while every watched layer's output was finite")
    reads = [c for c in culprits if c == "" or layer == c or layer.startswith(c + ".")]
    why = (f"; keeping {', '.join(c or 'the whole model' for c in reads)} in FP32 passes because "
           f"{'its' if len(reads) == 1 else 'their'} FP32 output makes the loss's ops run in FP32 too, at the cost "
           "of that layer's speed" if reads else "")
    return [f"{LOSS_OVERFLOW} outside the model ({what}): compute the loss in FP32 "
            f"(`loss_fn(out.float(), y)`, or the loss's ops under `torch.autocast(device, enabled=False)`){why}."]


def outside_model_advice(first: dict | None) -> list[str]:
    """Every layer in FP32 still breaks, and the script with its autocast regions off trains: its own code
    under autocast (outside the model's modules: a loss) makes the NaN/Inf."""
    first = first or {}
    where = (f" (the loss was non-finite at step {first.get('step')} while every watched layer's output was finite)"
             if first.get("loss_nonfinite") else
             f" (the gradient entering {first.get('layer') or 'the model'} from the loss was non-finite at step "
             f"{first.get('step')})" if first.get("from_loss") else "")
    return [f"{OUTSIDE_MODEL} in the whole script it trains: the script's own code under autocast, outside the model's "
            f"modules, makes the NaN/Inf{where}. Run that code (the loss) in FP32: after the `with torch.autocast(...)` "
            "block, or inside `with torch.autocast(device_type, enabled=False):` on `.float()` inputs. Under autocast a "
            "matmul runs in fp16 whatever its inputs, so `loss_fn(out.float(), y)` inside the block may not be enough."]


def fix_snippets(culprits: Sequence[str], types: dict[str, str], ops: list[dict],
                 half_weights: dict[str, str] | None = None, wrapper: str | None = None,
                 model_dtype: str | None = None) -> list[str]:
    """The fix for each culprit (``keep_fp32`` and its plain-PyTorch equivalent: autocast off around
    it, or, where its weights are stored in half precision (``half_weights``: a pure ``.half()``
    model, no autocast to turn off), the module in FP32 with its input and output cast), and what
    the drill-down's first ops say."""
    advice = []
    half_weights = half_weights or {}
    for c in culprits:
        path = module_expr(c, types=types)
        kind = types.get(c, "module")
        advice.append(f"Keep {c or 'the whole model'} ({kind}) in FP32{root_hint([c], types, wrapper)}: "
                      f"ampdoctor.keep_fp32({path})" + wrapped_hint(wrapper))
        advice.append("Plain PyTorch: " + plain_fix(path, half_weights_under(c, half_weights), kind, is_torch_module(kind),
                                                model_dtype))
    for o in ops:
        if o.get("pick") != "first":
            continue
        amax = f"abs-max {_fmt(o['absmax'])}" + recomputed_note(o)
        if o["op"] in ("matmul", "bmm", "baddbmm", "einsum") and o["phase"] == "forward":
            if _scaled_after(o.get("source") or ""):
                advice.append(f"{o['op']} at {o['where']} overflows ({amax}): that line scales the product after "
                              f"making it (`{o['source']}`), when it has already overflowed; scale an operand "
                              "before the product instead ((q * d**-0.5) @ k.T) or compute it in FP32.")
            else:
                advice.append(f"{o['op']} at {o['where']} overflows ({amax}): scale an operand before the product "
                              "(e.g. q * d**-0.5 before q @ k.T) or compute it in FP32; clamping after is too late.")
        elif o["op"] in ("mul", "pow", "square") and o["phase"] == "forward":
            what = {"mul": "the product", "pow": "the power", "square": "the square"}[o["op"]]
            advice.append(f"{o['op']} at {o['where']} overflows ({amax}): compute {what} in FP32 "
                          "(x.float()) or normalise by the abs-max first.")
    return advice


def _fmt(v: Any) -> str:
    return "inf" if v is None or (isinstance(v, float) and math.isinf(v)) else f"{v:.3g}"


def run_bisect(script: str | None, args: Sequence[str], out: Path, opts: BisectOptions,
               progress: Callable[[str, dict], None] | None = None, runner: TrialRunner | None = None) -> dict:
    """Bisect ``script`` (subprocess trials) or, with ``runner``, whatever that runner runs."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    emit = progress or (lambda kind, info: None)
    oracle = (opts.oracle or OracleConfig())
    if opts.divergence is not None:
        oracle.divergence = opts.divergence
    if runner is None:
        runner = TrialRunner(script, args, out, fmt=opts.fmt, oracle=oracle.to_dict(), timeout=opts.timeout,
                             max_steps=opts.max_steps, nproc=opts.nproc, fork=opts.fork)
    result: dict[str, Any] = {"verdict": "error", "culprits": [], "failure": None, "first_nonfinite": None, "ops": [],
                              "trials": [], "advice": [], "script": str(script), "args": list(args), "out": str(out)}
    try:
        return _bisect(opts, emit, runner, oracle, result, out, t_start)
    except BaseException as e:
        # Ctrl-C, SIGTERM (the CLI raises it as an interrupt) or a bug of ours: no trial outlives us.
        # Each runs in its own session, where the terminal's SIGINT does not reach it.
        stop = getattr(runner, "stop_all", None)
        if stop is not None:
            stop()
        if isinstance(e, KeyboardInterrupt):  # what is known so far, as an error result
            try:
                _write_result(result, runner, out, t_start, "error", exit_status=getattr(e, "exit_status", 130),
                              error=f"interrupted after {len(runner.trials)} finished trial(s); the trials' "
                                    f"folders are under {out / 'trials'}")
            except Exception as w:  # the interrupt is what the caller must see
                log.warning("ampdoctor bisect: could not write %s: %s", out / "bisect.json", w)
            try:  # a finished baseline's trace where a finished bisect keeps it: `ampdoctor report OUT` shows it
                e.baseline_trace = keep_baseline_trace(out, result)  # type: ignore[attr-defined]
            except Exception as w:
                log.warning("ampdoctor bisect: could not keep the baseline trace in %s: %s", out, w)
        raise


def _write_result(result: dict, runner: TrialRunner, out: Path, t_start: float, verdict: str,
                  exit_status: int | None = None, **extra: Any) -> dict:
    """Complete ``result`` with the trials run so far and write it to ``out/bisect.json``."""
    result.update(verdict=verdict, **extra)
    result["trials"] = [t.to_contract() for t in runner.trials]
    result["trial_details"] = [{"name": t.name, "folder": t.folder, "reason": t.reason, "error": t.error}
                               for t in runner.trials]
    result["seconds"] = round(time.monotonic() - t_start, 3)
    result["exit_status"] = VERDICT_EXIT[verdict] if exit_status is None else exit_status
    (out / "bisect.json").write_text(json.dumps(_clean(result), indent=2, default=_json_default, allow_nan=False))
    return result


def _bisect(opts: BisectOptions, emit: Callable[[str, dict], None], runner: TrialRunner, oracle: OracleConfig,
            result: dict, out: Path, t_start: float) -> dict:
    """The procedure itself (see :func:`run_bisect`), filling ``result``."""

    def finish(verdict: str, **extra: Any) -> dict:
        ended = _script_end_notes(result, runner)
        if ended:
            extra["notes"] = list(extra.get("notes") or result.get("notes") or []) + ended
        _write_result(result, runner, out, t_start, verdict, **extra)
        emit("done", result)
        return result

    def record(t: Trial) -> Trial:
        emit("trial", {"trial": t, "n": len(runner.trials)})
        return t

    reference = None
    if opts.divergence is not None:
        emit("start", {"name": "fp32-reference"})
        ctl = record(runner.run("fp32-reference", [""], pass_after=None, oracle=_control_oracle(opts)))
        reference = _losses(Path(ctl.folder) / "trace.sqlite")
        runner.reference = reference  # every later trial judges divergence against it
        result["fp32_control_losses"] = reference
        if ctl.outcome != "pass":
            return finish("not_precision" if ctl.outcome == "fail" else "inconclusive",
                          notes=[f"the FP32 reference run did not pass ({ctl.outcome})"] + _control_notes(ctl, opts))
    emit("start", {"name": "baseline"})
    base = record(runner.run("baseline", [], pass_after=None, all_modules=True))
    base_notes: list[str] = []
    if opts.repeat > 1 and base.outcome in ("pass", "fail"):
        # a flaky failure is what --repeat is for: the baseline is a trial set too, majority decides
        runs, need = [base], opts.repeat // 2 + 1
        while len(runs) < opts.repeat and max(sum(t.outcome == o for t in runs) for o in ("pass", "fail")) < need:
            runs.append(record(runner.run(f"baseline-{len(runs) + 1}", [], pass_after=None, all_modules=True)))
        fails = [t for t in runs if t.outcome == "fail"]
        passes = [t for t in runs if t.outcome == "pass"]
        base = fails[0] if fails and len(fails) >= len(passes) else passes[0]
        if fails and passes:
            base_notes.append(f"flaky: the baseline failed in {len(fails)} of {len(runs)} runs")
    if base.outcome in ("error", "timeout"):
        msg = base.error or base.outcome
        return finish("error", error=f"the script failed without a numerical failure: {msg}",
                      notes=[f"logs: {base.folder}/stderr.txt"])
    if base.outcome == "pass":
        return finish("healthy", notes=[f"the baseline ran {base.steps} steps without breaking"] + base_notes)
    if opts.fmt == "auto":  # the format the baseline found the script training in, for every later trial
        try:
            opts.fmt = str(TraceReader(Path(base.folder) / "trace.sqlite").meta().get("format") or "fp16")
        except Exception:  # noqa: BLE001 - no trace to read: fp16, as watch() falls back to
            opts.fmt = "fp16"
        runner.fmt = opts.fmt
    fail_step = base.step or 0
    result["failure"] = {"step": fail_step, "reason": base.reason}
    bl: Baseline = read_baseline(Path(base.folder) / "trace.sqlite", fail_step, base.reason)
    result["first_nonfinite"] = bl.first_nonfinite
    if not bl.candidates:
        return finish("inconclusive", notes=["no module ran while watching: is the model built with torch.nn modules?"])
    if opts.timeout is None:
        runner.timeout = max(60.0, 3 * base.seconds + 30)
    margin = opts.margin if opts.margin is not None else max(5, fail_step // 2)
    # The step reported is where the failure *started* (a skip window's or a scale backoff's first
    # step), which can be many steps before the step where the baseline's oracle could tell; a trial
    # must at least run past that step, or every trial "passes" before its failure can show.
    detected = max(fail_step, (base.steps or 0) - 1)
    pass_after = max(fail_step + margin, detected + 1)
    if opts.max_steps is not None and pass_after > opts.max_steps:
        # the trials end at --max-steps: they are judged, and the culprits verified, up to there only
        base_notes.append(f"--max-steps {opts.max_steps} ends every trial before step {pass_after} (the baseline's "
                          f"failure step {fail_step} plus the margin): trials pass at step {opts.max_steps}, and the "
                          "culprits are verified up to there; raise --max-steps to verify further")
        pass_after = opts.max_steps
    result["pass_after"] = pass_after
    control_after = CONTROL_HORIZON * pass_after
    if opts.max_steps is not None:
        control_after = min(control_after, opts.max_steps)
    result["control_pass_after"] = control_after
    control: dict[str, Any] = {"pass_after": control_after, "oracle": _control_oracle(opts)}
    if opts.timeout is None and runner.timeout is not None:  # (the default one: it runs further)
        control["timeout"] = CONTROL_HORIZON * runner.timeout
    root_set = frozenset(n for n in bl.candidates if bl.parent.get(n) is None)
    known: dict[frozenset, Any] = {frozenset(): "fail"}  # an outcome, or the runs so far (see find_culprits)
    first: list[tuple] = [("all-fp32", sorted(root_set), control)]
    hints = bl.hints if opts.use_hints else []
    if hints:
        first.append(("hint-" + (hints[0] or "root"), [hints[0]]))
    gpus = _gpus()
    jobs = max(1, opts.jobs)
    spent = 0
    if jobs > 1:  # the first guesses side by side: search trials, counted as they are with --jobs 1
        if opts.max_trials is not None:
            first = first[:opts.max_trials]
        spent = len(first)
        for t in runner.run_many(first, pass_after=pass_after, jobs=jobs, gpus=gpus if gpus > 1 else 0, lite=True):
            record(t)
            known[frozenset(t.fp32)] = [t.outcome]  # one run: with --repeat R the search runs the rest
    cache_runs = {"n": 0}

    horizon = {"pass_after": pass_after}  # what the search's trials run to (raised when the confirm fails)

    def test(fp32: frozenset) -> str:
        order = [n for n in bl.candidates if n in fp32]
        cache_runs["n"] += 1
        name = "all-fp32" if fp32 == root_set else ("+".join(n or "root" for n in order)[:60] or "none")
        kw = control if fp32 == root_set else {"pass_after": horizon["pass_after"]}
        t = record(runner.run(name.replace("/", "_"), order, lite=True, **kw))
        return t.outcome

    def search(known: dict, spent: int, after: int, hints: Sequence[str]) -> Any:
        horizon["pass_after"] = after
        return find_culprits(bl.candidates, test, parent=bl.parent, hints=hints, repeat=opts.repeat,
                             known=known, max_trials=opts.max_trials, spent=spent)

    sr = search(known, spent, pass_after, hints)
    confirm_notes: list[str] = []
    if sr.verdict == "culprit":
        sr, confirm_notes = _confirm(sr, opts, runner, record, search, root_set, pass_after, control_after, result)
    notes = base_notes + list(sr.notes) + confirm_notes
    if sr.verdict == "not_precision":
        ctl = next((t for t in runner.trials if t.name == "all-fp32"), None)
        notes += _control_notes(ctl, opts) if ctl is not None else []
        if not bl.half_weights and (opts.max_trials is None or len(runner.trials) - 1 < opts.max_trials):
            # every layer in FP32 still breaks: does the script train with its autocast regions off too? Where
            # it does, its own code under autocast (a loss: a matmul or exp there runs in fp16 whatever its
            # inputs) makes the NaN/Inf, outside the model: not a learning rate
            off = record(runner.run("autocast-off", sorted(root_set), lite=True, autocast_off=True, **control))
            try:
                turned = TraceReader(Path(off.folder) / "trace.sqlite").meta().get("autocast_turned_off")
            except Exception:  # noqa: BLE001 - no trace: the trial's outcome says what happened
                turned = None
            if turned != 0 and off.outcome in ("pass", "fail"):  # (0: the script enters no autocast, nothing to add)
                result["autocast_off_control"] = off.outcome
                if off.outcome == "pass":
                    result["advice"] = outside_model_advice(bl.first_nonfinite)
                    notes.append("with autocast off in the whole script (every layer in FP32 too) it trains: the "
                                 "script's own code under autocast makes the NaN/Inf, outside the model")
                else:
                    notes.append(f"with autocast off in the whole script it fails too: {off.reason} at step {off.step}")
    if sr.verdict != "culprit":
        extra: dict[str, Any] = {"notes": notes}
        if sr.verdict == "inconclusive":
            extra["suspects"] = sr.suspects
            extra["disagreements"] = sr.to_dict()["disagreements"]
        return finish(sr.verdict, **extra)
    culprits = list(sr.culprits)
    result["culprits"] = culprits
    ops: list[dict] = []
    drills: list[tuple[list[str], Path]] = []  # (culprits probed, the run's trace)
    if opts.drill:
        emit("start", {"name": "drill-down"})
        if len(culprits) == 1:
            d = record(runner.run("drill-down", [], pass_after=None, probe=culprits))
            drills.append((culprits, Path(d.folder) / "trace.sqlite"))
        else:
            # each culprit with the others forced: the run where it is what still breaks (minimality). With
            # nothing forced the run stops at the first failure, before a later culprit's overflow, and one
            # fed by another culprit (its input finite in FP32 but beyond the format's max) looks like one
            # whose input came in NaN/Inf
            for c in culprits:
                others = [x for x in culprits if x != c]
                d = record(runner.run(_drill_name(c), others, pass_after=None, probe=[c]))
                drills.append(([c], Path(d.folder) / "trace.sqlite"))
        for probed, trace in drills:
            ops += _ops_from(trace, probed)
    own_root = _own_code_root(bl, culprits)
    own: list[dict] = []
    if own_root is not None and opts.drill:
        # the root's own code (outside its submodules) made the first NaN/Inf, and a layer that feeds it was
        # found: probed with nothing forced, the root's first op that makes it from finite inputs is that code
        d = record(runner.run(_drill_name(own_root), [], pass_after=None, probe=[own_root]))
        own = [o for o in _ops_from(Path(d.folder) / "trace.sqlite", [own_root])
               if o["pick"] == "first" and o["phase"] == "forward" and o["layer"] == own_root]
        ops += own
    result["ops"] = ops
    result["advice"] = (own_code_advice(bl, own_root, culprits, own[:1]) + loss_advice(bl.first_nonfinite, culprits)
                        + fix_snippets(culprits, bl.types, ops, bl.half_weights, bl.wrapper, bl.model_dtype))
    if opts.drill:
        for probed, trace in drills:
            result["advice"] += _came_in_too_large(trace, probed, opts.fmt)
        for c in culprits:
            if not any(o["layer"] == c or o["layer"].startswith(c + ".") or c == "" for o in ops if o["phase"] == "forward"):
                notes.append(f"no op inside {c or 'the model'} overflowed in the drill-down: forcing it may help only by "
                             "making its output FP32 for the layers after it (type promotion); look at where the values "
                             "grow next (the report's first non-finite producer)")
    return finish("culprit", notes=notes)


def _confirm(sr: Any, opts: BisectOptions, runner: TrialRunner, record: Callable[[Trial], Trial],
             search: Callable[..., Any], root_set: frozenset, pass_after: int, control_after: int,
             result: dict) -> tuple[Any, list[str]]:
    """Run the culprits found (verified by trials that stop at ``pass_after``) as far as the all-FP32 control
    ran (``control_after``): an overflow elsewhere that starts after ``pass_after`` shows there. Where that
    trial fails, search again with every trial run to ``control_after`` (the sets that failed before still
    fail, the control passed there) and return that search's result, with the notes to add."""
    culprits = list(sr.culprits)

    def searched() -> int:  # the trials the search budget (--max-trials) counts
        return sum(not t.name.startswith(("baseline", "fp32-reference")) for t in runner.trials)

    passed = [t for t in runner.trials if t.outcome == "pass" and sorted(t.fp32) == sorted(culprits) and t.autocast]
    ran = max((t.step or t.steps or 0 for t in passed), default=0)
    if control_after <= pass_after or ran < pass_after:
        return sr, []  # capped by --max-steps, or the script ends before pass_after: nothing further to run
    if any(t.name == "all-fp32" for t in passed):  # the control's own set: it ran as far already (or to the end)
        result["confirmed_to"] = ran
        return sr, []
    if opts.max_trials is not None and searched() >= opts.max_trials:
        return sr, [f"the culprits are verified to step {pass_after} only: --max-trials {opts.max_trials} left no "
                    f"trial to run them to step {control_after}"]
    t = record(runner.run("confirm", culprits, lite=True, pass_after=control_after))
    shown = ", ".join(c or "the whole model" for c in culprits)
    if t.outcome == "pass":
        result["confirmed_to"] = t.step or t.steps or control_after
        return sr, []
    if t.outcome != "fail":
        return sr, [f"the run with {shown} in FP32 to step {control_after} (as far as the all-FP32 control) ended in "
                    f"{t.outcome}{': ' + t.error if t.error else ''}: the culprits are verified to step {pass_after} only"]
    note = (f"with {shown} in FP32 the run passed step {pass_after} but broke at step {t.step} ({t.reason}) when run "
            f"to step {control_after}: searched again with every trial run to step {control_after}")
    # a set that failed by pass_after fails by control_after too (the same steps, run further); the all-FP32
    # control ran to control_after and passed
    runs: dict[frozenset, list[str]] = {}
    for tr in sr.trials:
        runs.setdefault(tr.fp32, []).append(tr.outcome)
    known: dict[frozenset, Any] = {s: "fail" for s, o in runs.items() if all(x == "fail" for x in o)}
    known.update({frozenset(): "fail", frozenset(culprits): "fail", root_set: "pass"})
    again = search(known, searched(), control_after, [])
    if again.verdict == "culprit":
        result["pass_after"] = control_after
        result["confirmed_to"] = control_after
        return again, [note]
    return again, [note, f"{shown} in FP32 passes step {pass_after}, not step {control_after}"]


def _script_end_notes(result: dict, runner: TrialRunner) -> list[str]:
    """Where the script ended before a passing trial reached its horizon (``pass_after``, or the control's
    ``control_pass_after``), the trials were checked up to the script's end only: the horizons in
    ``result`` become the steps those trials ran (they claimed steps no trial ran), and a note says so."""
    short = []
    for key, control in (("pass_after", False), ("control_pass_after", True)):
        horizon = result.get(key)
        ran = [t.step or t.steps for t in runner.trials if t.outcome == "pass"
               and (t.name in ("all-fp32", "confirm")) == control
               and not t.name.startswith(("baseline", "fp32-reference", "drill-down"))]
        if horizon is None or not ran or max(ran) >= horizon:
            continue
        result[key] = max(ran)
        short.append((max(ran), f"the all-FP32 control's step {horizon}" if control else
                      f"step {horizon} (the failure step plus the margin) that the trials run to"))
    if not short:
        return []
    ends = sorted({n for n, _ in short})
    return [f"the script ended after {' or '.join(map(str, ends))} steps, before {' and '.join(w for _, w in short)}: "
            "the trials that passed were checked up to its end only; give it more steps (its own argument) to check "
            "further"]


def _control_oracle(opts: BisectOptions) -> dict:
    """The all-FP32 control's oracle settings beyond the others': the loss blow-up check."""
    return {"blowup": opts.control_blowup} if opts.control_blowup is not None else {}


def _control_notes(ctl: Trial, opts: BisectOptions) -> list[str]:
    if ctl.outcome != "fail":
        return []
    if ctl.reason == "divergence" and opts.control_blowup is not None:
        return [f"with every layer in FP32 the loss grew over {opts.control_blowup:g}x its first steps' from step "
                f"{ctl.step}: training diverges in any precision (a learning rate too high?)"]
    return [f"with every layer in FP32 it fails too: {ctl.reason} at step {ctl.step}"]


def _losses(trace: Path) -> dict[str, float]:
    try:
        with TraceReader(trace) as r:
            return {str(s["step"]): s["loss"] for s in r.steps() if s["loss"] is not None and math.isfinite(s["loss"])}
    except Exception:
        return {}


def keep_baseline_trace(out_dir: Path, res: dict) -> Path | None:
    """The baseline trial's trace, copied into the run folder as ``trace.sqlite``: ``ampdoctor report
    DIR`` then shows it with the bisect result beside it. None when there is none (it never ran)."""
    import shutil

    from ..trace import trace_problem

    base = next((d for d in res.get("trial_details", []) if d["name"] == "baseline"), None)
    trace = Path(base["folder"]) / "trace.sqlite" if base is not None else None
    if trace is None or not trace.exists():
        return None
    # with --nproc-per-node every rank's (``trace.rankN.sqlite``): `ampdoctor report DIR --rank N` shows it
    traces = [trace, *sorted(trace.parent.glob("trace.rank*.sqlite"))]
    dests = [Path(out_dir) / t.name for t in traces]
    for dest in dests:
        problem = trace_problem(dest)
        if problem:  # README: a file there that is not an ampdoctor trace is never overwritten
            raise ValueError(problem)
    for src, dest in zip(traces, dests):
        for suffix in ("-wal", "-shm"):  # an earlier trace's log must not be replayed into the copy
            Path(f"{dest}{suffix}").unlink(missing_ok=True)
        shutil.copy(src, dest)
    return dests[0]


def _clean(o: Any) -> Any:
    """JSON has no Inf/NaN: non-finite numbers become null (``nonfinite`` says why)."""
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


def _json_default(o: Any) -> Any:
    if isinstance(o, float):
        return None
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    return str(o)


def exit_status(verdict: str) -> int:
    return VERDICT_EXIT.get(verdict, 1)


__all__ = ["BisectOptions", "run_bisect", "exit_status", "fix_snippets", "VERDICT_EXIT"]
