"""``ampdoctor bisect``: the click command (printing lives here, the work in driver.py)."""

from __future__ import annotations

import os
import shlex
import signal
import stat
import sys
from pathlib import Path

import click

from ..formats import FORMATS
from ..oracle import OracleConfig
from ..report.culprit import CAME_IN, OWN_CODE, trains_without_autocast
from ..report.phrasing import shown_layer
from .driver import CONTROL_BLOWUP

_ORACLE = OracleConfig()  # its defaults, shown in --help


def _shown(name: str) -> str:
    """A forced module's name on the terminal: the root of the model (``""``), or of a second model
    (``D:``), is the whole of it."""
    if not name:
        return "(whole model)"
    return f"{name} (whole model)" if name.endswith(":") else name


def _progress(kind: str, info: dict) -> None:
    if kind == "start":
        click.echo(f"  ... {info['name']}", err=True)
    elif kind == "trial":
        t = info["trial"]
        forced = (", ".join(map(_shown, t.fp32)) or "nothing") + ("; autocast off" if not getattr(t, "autocast", True) else "")
        if t.name == "confirm":  # the culprits found, run as far as the all-FP32 control
            forced += "; confirm, as far as the all-FP32 control"
        what = t.outcome + (f" at step {t.step} ({t.reason})" if t.outcome == "fail" else "")
        if t.outcome in ("error", "timeout") and t.error:
            what += f": {t.error}"
        click.echo(f"trial {t.index + 1:>2}  {t.seconds:6.1f}s  fp32=[{forced}]  -> {what}", err=True)


def _stdin_piped() -> bool:
    """bisect's stdin is a pipe or a file (``echo 60 | ampdoctor bisect ...``), not a terminal or nothing."""
    try:
        mode = os.fstat(0).st_mode
        return stat.S_ISFIFO(mode) or (stat.S_ISREG(mode) and os.fstat(0).st_size > 0)
    except (OSError, ValueError):
        return False


def _from_loss(res: dict, layer: str) -> bool:
    """Whether the baseline's first non-finite value was the loss's gradient entering ``layer`` (or a layer in it)."""
    fn = res.get("first_nonfinite") or {}
    at = fn.get("layer") or ""
    return bool(fn.get("from_loss")) and (layer == "" or at == layer or at.startswith(layer + "."))


def _summary(res: dict) -> str:
    lines = ["", f"verdict: {res['verdict']}"]
    if res.get("failure"):
        f = res["failure"]
        lines.append(f"baseline breaks at step {f['step']}: {f['reason']}")
    if res.get("first_nonfinite"):
        fn = res["first_nonfinite"]
        if fn.get("at_start"):
            lines.append(f"first non-finite: the weights of {shown_layer(fn['layer'])}, already NaN/Inf when the run "
                         "began (a checkpoint saved after a run broke, or a bad initialisation)")
        elif fn.get("input_nonfinite"):
            lines.append(f"first non-finite: the input of {shown_layer(fn['layer'])} at step {fn['step']} (already "
                         "non-finite: the data, or code outside the watched model)")
        elif fn.get("from_loss"):
            lines.append(f"first non-finite: the gradient reaching {shown_layer(fn['layer'])} from the loss at step "
                         f"{fn['step']}" + (" (the loss itself was non-finite: its computation overflowed)"
                                            if fn.get("loss_nonfinite") else " (the loss's gradient overflowed)"))
        else:
            lines.append(f"first non-finite: {fn['kind']} of {shown_layer(fn['layer'])} at step {fn['step']}")
    if res["culprits"]:
        lines.append("culprit(s): " + ", ".join(map(_shown, res["culprits"])))
    for o in res.get("ops", []):
        amax = "inf" if o["absmax"] is None or o["absmax"] == float("inf") else f"{o['absmax']:.3g}"
        pick = "worst" if o["pick"] == "worst_backward" else o["pick"]  # (the phase, below, says backward)
        lines.append(f"  {pick:>6} op in {shown_layer(o['layer'])}: {o['op']} at {o['where']} "
                     f"({o['phase']}, abs-max {amax}"
                     f"{' when recomputed in FP32' if o.get('absmax_of') == 'fp32_recompute' else ''})" + (
                         (": its gradient came in non-finite from the loss" if _from_loss(res, o["layer"]) else
                          ": its gradient came in non-finite from outside the layer") if o.get("came_in") else ""))
    n = len(res["trials"])
    lines.append(f"{n} trial(s), {res.get('seconds', 0):.1f}s")
    if res["verdict"] == "healthy":
        lines.append("The baseline run did not break: nothing to bisect (raise --max-steps or check the arguments).")
    elif trains_without_autocast(res):
        lines.append("It breaks with every layer in FP32 too, but trains with autocast off in the whole script: the "
                     "NaN/Inf is made by the script's own code under autocast, outside the model (see fix).")
    elif res["verdict"] == "not_precision":
        lines.append("It breaks with every layer in FP32 too: not a precision problem (learning rate, data, a bug?).")
    elif res["verdict"] == "error":
        lines.append(res.get("error", "the script failed"))
    elif res["verdict"] == "inconclusive":
        lines.append("The trials could not settle it: " + "; ".join(res.get("notes", [])))
        if res.get("suspects"):
            lines.append("smallest set known to pass: " + ", ".join(map(_shown, res["suspects"])))
    for a in res.get("advice", []):  # (a culprit's input that came in too large: the cause lies before it)
        lines.append(f"{'cause' if a.startswith(CAME_IN) or a.startswith(OWN_CODE) else 'fix'}: {a}")
    for note in res.get("notes", []) if res["verdict"] != "inconclusive" else []:
        lines.append(f"note: {note}")
    lines.append(f"run folder: {res['out']}  (trials, logs, bisect.json; report: ampdoctor report "
                 f"{shlex.quote(str(res['out']))})")
    return "\n".join(lines)


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Run folder [default: ./ampdoctor-runs/<script>-bisect-<time>].")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the result JSON here too.")
@click.option("--format", "fmt", type=click.Choice(["auto", *sorted(FORMATS)], case_sensitive=False), default="auto",
              show_default=True, help="target format; auto: what the baseline trains in (autocast's dtype, a .half() model's)")
@click.option("--jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Independent trials at once (one GPU each when several are visible).")
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True,
              help="Runs per trial set; the majority decides (for flaky failures).")
@click.option("--timeout", type=float, default=None, help="Seconds per trial [default: 3x the baseline + 30, >= 60].")
@click.option("--max-steps", type=click.IntRange(min=1), default=None, help="Cap every run at N steps.")
@click.option("--margin", type=click.IntRange(min=0), default=None,
              help="A trial passes after the baseline's failure step + this many steps [default: max(5, step/2)].")
@click.option("--max-trials", type=click.IntRange(min=1), default=None, help="Give up (inconclusive) after N search trials (the baseline and the drill-down not counted).")
@click.option("--nonfinite-k", type=click.IntRange(min=1), default=3, show_default=True,
              help="Fail when the loss is non-finite K steps in a row.")
@click.option("--scale-floor", type=float, default=None,
              help=f"Fail when the GradScaler scale drops below this [default: {_ORACLE.scale_floor}].")
@click.option("--skip-window", type=click.IntRange(min=1), default=None,
              help=f"Window W for the skipped-steps criterion [default: {_ORACLE.skip_window}].")
@click.option("--skip-frac", type=float, default=None,
              help=f"Fail when more than this fraction of the last W steps were skipped [default: {_ORACLE.skip_frac}]; "
                   f"the first {_ORACLE.startup_grace} steps of GradScaler start-up backoff never count (more "
                   "while the scale halves at each, once a step is taken).")
@click.option("--divergence", type=float, default=None,
              help="Also fail when the final loss is worse than the FP32 control's by this factor (runs the control first).")
@click.option("--control-blowup", type=float, default=CONTROL_BLOWUP, show_default=True,
              help="The all-FP32 control fails (divergence: not a precision problem) when its loss grows above this "
                   "factor times its first steps'; 0 turns the check off.")
@click.option("--nproc-per-node", "nproc", type=click.IntRange(min=1), default=1, show_default=True,
              help="Launch every trial through torchrun with N processes (DDP scripts).")
@click.option("--no-drill", is_flag=True, help="Skip the op-level drill-down run.")
@click.option("--no-hints", is_flag=True, help="Do not start from the layer the baseline trace blames (pure group testing).")
@click.argument("script", type=click.Path())
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def bisect_command(out, json_path, fmt, jobs, repeat, timeout, max_steps, margin, max_trials, nonfinite_k, scale_floor,
                   skip_window, skip_frac, divergence, control_blowup, nproc, no_drill, no_hints, script, script_args):
    """Find the smallest set of layers whose FP32 cast makes SCRIPT stop breaking.

    Options go before SCRIPT; everything after it (or after `--`) is the script's own.
    Exit status: 0 culprit or healthy, 1 error, 2 usage, 3 not_precision, 4 inconclusive."""
    from ..cli import (
        _script_args,
        claim_out,
        default_out,
        misplaced_options,
        output_problems,
        reject_unknown_option,
    )
    from ..runner import launch_problem
    from .driver import BisectOptions, run_bisect

    reject_unknown_option(script)
    problem = launch_problem(script)
    if problem:
        raise click.UsageError(problem)
    if not (control_blowup == 0 or control_blowup > 1):  # (NaN too)
        raise click.BadParameter(f"{control_blowup} (a factor > 1, or 0 for no check)", param_hint="'--control-blowup'")
    if timeout is not None and not timeout > 0:  # (NaN too)
        raise click.BadParameter(f"{timeout} (seconds per trial: must be > 0)", param_hint="'--timeout'")
    oc = {"nonfinite_k": nonfinite_k}
    for k, v in (("scale_floor", scale_floor), ("skip_window", skip_window), ("skip_frac", skip_frac),
                 ("divergence", divergence)):
        if v is not None:
            oc[k] = v
    try:
        oracle = OracleConfig.from_dict(oc)
    except (TypeError, ValueError) as e:
        raise click.BadParameter(str(e)) from None
    output_problems(json=json_path)
    out_dir = Path(out) if out else default_out(script, "bisect")
    claim_out(out_dir)  # (a foreign trace.sqlite, where the baseline's is copied at the end, or another run
    # or bisect writing there: refused)
    opts = BisectOptions(fmt=fmt.lower(), oracle=oracle, timeout=timeout, max_steps=max_steps, margin=margin, jobs=jobs,
                         repeat=repeat, drill=not no_drill, max_trials=max_trials, divergence=divergence,
                         use_hints=not no_hints, nproc=nproc, fork=True,  # this process ran no torch op
                         control_blowup=control_blowup or None)
    click.echo(f"ampdoctor bisect: {script} (run folder {out_dir})", err=True)
    if _stdin_piped():
        click.echo("ampdoctor bisect: note: the trials run with no stdin; what is piped in is not passed on "
                   "(give the script its input as an argument or a file)", err=True)
    args = _script_args(script_args)
    try:  # `kill` ends the trials too, as Ctrl-C does
        previous, installed = signal.signal(signal.SIGTERM, _terminated), True
    except ValueError:  # not the main thread (an embedding caller): no handler of ours
        previous, installed = None, False
    try:
        res = run_bisect(script, args, out_dir, opts, progress=_progress)
    except KeyboardInterrupt as e:  # the driver stopped every running trial before this
        status = getattr(e, "exit_status", 130)
        said = getattr(e, "baseline_trace", None) is not None  # (kept in out_dir by the driver)
        click.echo(f"\nampdoctor bisect: {'terminated' if status == 143 else 'interrupted'}; stopped the running "
                   f"trial(s); what ran is in {out_dir / 'trials'}"
                   + (f"; the baseline's report: ampdoctor report {shlex.quote(str(out_dir))}" if said else ""),
                   err=True)
        if (out_dir / "bisect.json").exists():
            _copy_json(out_dir, json_path)
        sys.exit(status)
    finally:
        if installed:  # (None: a handler not set from Python; the default is the nearest)
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
    if res["verdict"] == "error" and {"-h", "--help"} & set(args) and "never trained" in (res.get("error") or ""):
        base = next((d for d in res.get("trial_details") or [] if d.get("folder")), None)
        try:
            click.echo((Path(base["folder"]) / "stdout.txt").read_text(errors="replace").rstrip("\n"))
        except (OSError, TypeError):
            pass
        click.echo(f"ampdoctor: {script} printed its help (above) and trained nothing (nothing to bisect).", err=True)
        sys.exit(0)  # (as `run` does)
    click.echo(_summary(res))
    if res["verdict"] == "error":
        tb = _script_traceback(res)
        if tb:
            click.echo(f"\nThe script raised (in trial {Path(tb[0]).parent.name}):\n{tb[1]}", err=True)
    if res["verdict"] in ("error", "healthy"):
        hint = misplaced_options(click.get_current_context().command, args)
        if hint:
            click.echo("note:" + hint)
    _copy_json(out_dir, json_path)
    _write_report(out_dir, res)
    sys.exit(res["exit_status"])


def _script_traceback(res: dict, most: int = 40) -> tuple[str, str] | None:
    """(its stderr.txt, the traceback) the script printed in the trial that made the result an error
    (the baseline, mostly): its last ``most`` lines, from the last ``Traceback`` on."""
    for d in res.get("trial_details") or []:
        if not d.get("error") or not d.get("folder"):
            continue
        path = Path(d["folder"]) / "stderr.txt"
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        at = text.rfind("Traceback (most recent call last):")
        if at >= 0:
            lines = text[at:].rstrip("\n").splitlines()
            return str(path), "\n".join(lines if len(lines) <= most else [lines[0], "  ...", *lines[-most:]])
    return None


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where bisect waits, so that it ends its trials as on Ctrl-C."""

    exit_status = 143


def _terminated(signum, frame) -> None:
    raise _Terminated()


def _copy_json(out_dir: Path, json_path: str | None) -> None:
    if not json_path:
        return
    try:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text((out_dir / "bisect.json").read_text())
    except OSError as e:  # the result is in the run folder anyway
        click.echo(f"ampdoctor: could not write {json_path}: {type(e).__name__}: {e} (the result is in "
                   f"{out_dir / 'bisect.json'})", err=True)


def _write_report(out_dir: Path, res: dict) -> None:
    """report.html/json of the baseline trial with the bisect result beside it."""
    from .driver import keep_baseline_trace

    try:
        if keep_baseline_trace(out_dir, res) is None:
            return
        from ..cli import _write_outputs
        from ..report import build_report

        _write_outputs(build_report(out_dir), None, None, None, out_dir)
    except Exception as e:  # the bisect result stands without its report
        click.echo(f"ampdoctor: could not write the report: {e}", err=True)
