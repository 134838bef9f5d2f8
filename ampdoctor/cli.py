"""The command line: ``ampdoctor run | bisect | report``. The only module that prints."""

from __future__ import annotations

import datetime as _dt
import logging
import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Callable, Sequence

import click

from .formats import AUTO, FORMATS

SCRIPT_CTX = {"ignore_unknown_options": True, "allow_interspersed_args": False}


def _script_args(args: Sequence[str]) -> list[str]:
    args = list(args)
    return args[1:] if args and args[0] == "--" else args


def misplaced_options(command: click.Command, args: Sequence[str]) -> str:
    """A hint for a script that failed or never trained: ``args`` (the script's) hold options of
    ``command`` (``--out``, ``--max-steps=5``), which went to the script because they came after
    its name. Empty when they hold none (a script may take options of the same name)."""
    ours = {o for p in command.params for o in p.opts if o.startswith("--") and o != "--help"}
    found = []
    for a in args:
        name = a.split("=", 1)[0]
        if name in ours and name not in found:
            found.append(name)
    if not found:
        return ""
    return (f" {', '.join(f'`{n}`' for n in found)} came after the script's name, so the script got "
            f"{'it' if len(found) == 1 else 'them'}: ampdoctor's own options go before the script "
            f"(`ampdoctor {command.name} {found[0]} ... script.py ARGS`).")


def reject_unknown_option(script: str) -> None:
    """SCRIPT is the first argument that is not one of our options, so a mistyped option before
    it (``--outdir x train.py``) arrives as the script's name: say it is no option of ours, with
    click's close-match suggestion, not "script not found: --outdir". An existing file whose name
    starts with ``-`` is still a script."""
    if not script.startswith("-") or script == "-" or Path(script).is_file():
        return
    import difflib

    ctx = click.get_current_context()
    name = script.split("=", 1)[0]
    ours = sorted({o for p in ctx.command.get_params(ctx) for o in p.opts + p.secondary_opts if o.startswith("-")})
    raise click.NoSuchOption(name, possibilities=difflib.get_close_matches(name, ours), ctx=ctx)


def _in_the_way(path: Path) -> tuple[Path | None, Path | None]:
    """(the nearest of ``path`` and its folders that exists, a file among them that is in the way)."""
    for parent in [path, *path.parents]:
        if parent.exists():
            return parent, (None if parent.is_dir() else parent)
    return None, None


def _why(path: Path, e: OSError) -> str:
    """Why ``path`` cannot be made: the file in its way, or the system's reason."""
    blocker = _in_the_way(path)[1]
    return f"{blocker} is a file, not a folder" if blocker is not None else (e.strerror or str(e))


def output_problems(**paths: str | None) -> None:
    """A usage error, before anything runs, for an output file asked for (``json="x/r.json"``, the
    option's name as key) that cannot be written: a folder, under a file, or in a folder not writable."""
    for option, path in paths.items():
        if not path:
            continue
        p = Path(path)
        flag = f"--{option} {path}"
        if p.is_dir():
            raise click.UsageError(f"{flag} is a folder: give a file name")
        near, blocker = _in_the_way(p.parent)
        if blocker is not None:
            raise click.UsageError(f"{flag}: {blocker} is a file, not a folder")
        if near is not None and not os.access(near, os.W_OK | os.X_OK):
            raise click.UsageError(f"{flag}: cannot write into {near}")


def out_problem(out_dir: Path, names: Sequence[str] = ("trace.sqlite",)) -> None:
    """A usage error, before anything runs, when the run folder holds a file of ours (``trace.sqlite``)
    that is not an ampdoctor trace: it is never overwritten."""
    from .trace import trace_problem

    for name in names:
        problem = trace_problem(out_dir / name)
        if problem:
            raise click.UsageError(f"{problem}: pick another --out or remove it")


def claim_out(out_dir: Path, names: Sequence[str] = ("trace.sqlite",)) -> Callable[[], None]:
    """Make ``out_dir`` (the run folder) this command's, before anything runs: a usage error when another
    ampdoctor run or bisect that is still running writes there (its traces would mix with this one's).
    Told by the lock file that every run and bisect holds in its folder (an advisory lock, released
    when its process ends, however it ends), and by a trace there that a live process still writes
    (a script's own ``watch()``). The lock is released when the command ends, or by the function
    returned. First the :func:`out_problem` check."""
    from .trace import live_writer, trace_meta

    out_problem(out_dir, names)

    def refuse(what: str) -> None:
        raise click.UsageError(f"{what}: pick another --out, or wait until it ends")

    release = _lock_out(out_dir, refuse)
    for name in names:
        pid = live_writer(trace_meta(out_dir / name) if (out_dir / name).is_file() else None)
        if pid is not None:
            release()
            refuse(f"process {pid} is still writing the trace {out_dir / name}")
    return release


def _lock_out(out_dir: Path, refuse) -> Callable[[], None]:
    """Take the run folder's lock (``refuse`` says who holds it); returns what releases it, which also
    runs when the command ends."""
    from .runfolder import FolderHeld, lock

    ctx = click.get_current_context(silent=True)
    try:
        release = lock(out_dir, ctx.info_name if ctx is not None else "")
    except FolderHeld as e:
        refuse(str(e))
    except OSError as e:  # a file on the way, a read-only file system: the folder cannot be made
        raise click.UsageError(f"cannot make the run folder {out_dir}: {_why(out_dir, e)}: pick another --out") from None
    if ctx is not None:
        ctx.call_on_close(release)
    return release


def default_out(script: str, command: str) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path("ampdoctor-runs") / f"{Path(script).stem}-{command}-{stamp}"
    out, i = base, 1
    while out.exists():
        out = base.with_name(f"{base.name}-{i}")
        i += 1
    return out


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record comes (a script may replace it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


class _Formatter(logging.Formatter):
    """A message that begins with "ampdoctor" as it is (it says which part of ampdoctor speaks:
    "ampdoctor trace: ...", written so for the user's own logging too); any other message after its
    logger's name ("ampdoctor.bisect.search: ...")."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text if text.startswith("ampdoctor") else f"{record.name}: {text}"


def _setup_logging(verbose: int) -> None:
    """Our messages go to stderr through a handler on the ``ampdoctor`` logger only. The root logger is
    the script's: ``ampdoctor run`` executes it in this process, and a ``logging.basicConfig`` of ours
    would make the script's own a no-op (its INFO lines gone) and print its libraries' records twice.
    Undone when the command ends."""
    level = logging.WARNING if verbose == 0 else (logging.INFO if verbose == 1 else logging.DEBUG)
    logger = logging.getLogger("ampdoctor")
    saved = (logger.level, logger.propagate)
    handler = _StderrHandler()
    handler.setFormatter(_Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False

    def undo() -> None:
        logger.removeHandler(handler)
        logger.level, logger.propagate = saved

    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        ctx.call_on_close(undo)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ampdoctor")
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
def main(verbose: int) -> None:
    """ampdoctor: find where and why mixed-precision (FP16/BF16/FP8) training breaks."""
    _setup_logging(verbose)


def _report_options(f):
    f = click.option("--sort", type=click.Choice(["order", "worst"]), default="order", show_default=True,
                     help="Table order: execution order or worst first.")(f)
    f = click.option("--top", type=click.IntRange(min=1), default=None,
                     help="Show only the first N rows of each table.")(f)
    f = click.option("--only-bad", is_flag=True, help="Only layers with NaN/Inf/overflow/subnormal/flush.")(f)
    f = click.option("--match", default=None, help="Only layers whose name or type contains this text.")(f)
    f = click.option("--kinds", default="activation,gradient", show_default=True,
                     help="Tables to show: activation,gradient,weight,weight_grad.")(f)
    return f


def _print_report(report, sort: str, top: int | None, only_bad: bool, match: str | None, kinds: str) -> None:
    ks = _kinds(kinds)
    # the terminal's width (COLUMNS where set); into a pipe or a file, 160
    width = max(80, min(240, shutil.get_terminal_size((160, 24)).columns))
    click.echo()  # the script may have left a `\r` progress line open
    click.echo(report.to_text(kinds=ks, sort=sort, top=top, only_bad=only_bad, match=match, width=width))


def _kinds(kinds: str) -> list[str]:
    ks = [k.strip() for k in kinds.split(",") if k.strip()]
    bad = [k for k in ks if k not in ("activation", "gradient", "weight", "weight_grad")]
    if bad:
        raise click.BadParameter(f"unknown kind(s) {bad}; use activation,gradient,weight,weight_grad", param_hint="--kinds")
    return ks


def _write_outputs(report, json_path: str | None, html_path: str | None, csv_path: str | None, out: Path | None) -> bool:
    """The run folder's report.json/html, then the paths asked for (their folders made as needed). One
    that cannot be written is said on stderr and the others are still written; False if any failed."""
    try:
        from .report import html as _html  # noqa: F401
    except ImportError:
        _html = None
    if html_path and _html is None:
        raise click.ClickException("HTML reports are not available in this installation")
    from .report.model import write_whole

    jobs = []  # (what, path, write, say where it went)
    page: list[str] = []  # the HTML, rendered once for the run folder's copy and --html's (its plots take seconds)

    def write_html(p: Path) -> None:  # html.write_html, with the page kept (the caller made the folder)
        if not page:
            page.append(_html.render_html(report))
        write_whole(p, page[0])

    if out is not None:
        jobs.append(("JSON report", out / "report.json", report.to_json, False))
        if _html is not None:
            jobs.append(("HTML report", out / "report.html", write_html, False))
    if json_path:
        jobs.append(("JSON report", json_path, report.to_json, True))
    if html_path:
        jobs.append(("HTML report", html_path, write_html, True))
    if csv_path:
        from .report.csvout import write_csv
        jobs.append(("CSV table", csv_path, lambda p: write_csv(report, p), True))
    ok = True
    for what, p, write, say in jobs:
        try:
            Path(p).parent.mkdir(parents=True, exist_ok=True)
            write(p)
        except Exception as e:  # a plot failing, a folder that cannot be written: the others are still written
            click.echo(f"ampdoctor: could not write {what} {p}: {type(e).__name__}: {e}", err=True)
            ok = False
            continue
        if say:
            click.echo(f"{what}: {p}")
        else:
            logging.getLogger("ampdoctor.report").info("ampdoctor: wrote the %s %s", what, p)
    return ok


@main.command(context_settings=SCRIPT_CTX)
@click.option("--out", "out", type=click.Path(file_okay=False), default=None,
              help="Run folder for the trace and reports [default: ./ampdoctor-runs/<script>-run-<time>].")
@click.option("--format", "fmt", type=click.Choice([AUTO] + sorted(FORMATS), case_sensitive=False), default=AUTO,
              show_default=True,
              help="Target format the statistics are measured against (auto: what the script trains in: "
                   "autocast's dtype, else the model's fp16/bf16 dtype, else fp16).")
@click.option("--every", type=click.IntRange(min=1), default=1, show_default=True, help="Record full statistics every N steps.")
@click.option("--max-steps", type=click.IntRange(min=1), default=None, help="Stop the script cleanly after N steps.")
@click.option("--all-modules", is_flag=True, help="Statistics for container modules too [default: leaves and modules that own parameters].")
@click.option("--nproc-per-node", "nproc", type=click.IntRange(min=1), default=1, show_default=True,
              help="Launch through torchrun with N processes (DDP scripts); one trace per rank.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Also write the report as JSON here.")
@click.option("--html", "html_path", type=click.Path(dir_okay=False), default=None, help="Also write the HTML report here.")
@_report_options
@click.argument("script", type=click.Path())
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def run(out, fmt, every, max_steps, all_modules, nproc, json_path, html_path, sort, top, only_bad, match, kinds, script,
        script_args):
    """Run SCRIPT once under watch; write a trace and print the per-layer report.

    Options go before SCRIPT; everything after SCRIPT (or after `--`) is the script's own.
    Exits with the script's status (3 if it never trained)."""
    from .config import RunConfig
    from .report import build_report
    from .runner import EXIT_NEVER_TRAINED, ScriptNotFound, launch_problem, run_script

    reject_unknown_option(script)
    problem = launch_problem(script)
    if problem:
        raise click.UsageError(problem)
    _kinds(kinds)  # a usage error before the script runs, not after
    output_problems(json=json_path, html=html_path)
    out_dir = Path(out) if out else default_out(script, "run")
    traces = ["trace.sqlite"] + [f"trace.rank{r}.sqlite" for r in range(1, nproc)]
    claim_out(out_dir, traces)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = RunConfig(trace=str(out_dir / "trace.sqlite"), format=fmt.lower(), every=every, max_steps=max_steps,
                    all_modules=all_modules)
    click.echo(f"ampdoctor: running {script} (trace in {out_dir})", err=True)
    if nproc > 1:
        _run_torchrun(script, _script_args(script_args), cfg, out_dir, nproc, (sort, top, only_bad, match, kinds),
                      json_path, html_path)
        return
    cwd = os.getcwd()
    args = _script_args(script_args)

    def show(result):
        os.chdir(cwd)  # a script that changed directory: --out, --json, --html are relative to where we were started
        report = build_report(result.trace)
        _print_report(report, sort, top, only_bad, match, kinds)
        _write_outputs(report, json_path, html_path, None, out_dir)
        click.echo(f"run folder: {out_dir}  (re-render: ampdoctor report {shlex.quote(str(out_dir))})")
        return report

    def hard_exit(result) -> None:  # the script called os._exit(): the report now, then that exit
        show(result)
        click.echo(f"ampdoctor: {script} ended the process with os._exit({result.exit_code}).", err=True)
        sys.stdout.flush()
        sys.stderr.flush()

    try:
        result = run_script(script, args, cfg, on_hard_exit=hard_exit)
    except ScriptNotFound as e:
        raise click.UsageError(str(e)) from None
    finally:
        os.chdir(cwd)
    if result.status == "exited" and result.error:  # `raise SystemExit("message")`: Python prints the message
        click.echo(result.error, err=True)
    if not result.trained and result.status == "finished" and {"-h", "--help"} & set(args):
        click.echo(f"ampdoctor: {script} printed its help and trained nothing (nothing recorded).", err=True)
        sys.exit(0)
    report = show(result)
    if result.status == "crashed":
        click.echo(f"\nThe script raised {result.error}\n{result.traceback or ''}", err=True)
        click.echo(f"ampdoctor: {script} failed after {result.completed} completed step(s); the trace of what ran is kept in "
                   f"{out_dir}.", err=True)
        sys.exit(result.exit_code or 1)
    if result.status == "stopped":
        click.echo(f"ampdoctor: stopped the script cleanly ({result.stop_reason}) after {result.steps} step(s).", err=True)
        sys.exit(0)
    if not result.trained and result.children:
        click.echo(f"ampdoctor: {script} never trained in the process ampdoctor runs it in; it started "
                   f"{_children(result.children)}, which ampdoctor does not follow: training that runs in them is "
                   "not in this report (a watch() in them records to a trace of its own, whose path it prints). To watch every rank, launch them through torchrun instead: make the script "
                   "train in the process it is started in (rank and world size from the RANK/WORLD_SIZE/LOCAL_RANK "
                   "environment variables, no mp.spawn) and run "
                   f"`ampdoctor run --nproc-per-node N {shlex.quote(script)}`; or for one process, call the training "
                   "function directly.", err=True)
        sys.exit(result.exit_code or EXIT_NEVER_TRAINED)
    if not result.trained and report.diagnosis.broke:
        # the loop ran, but every step was left out on a NaN/Inf (`if not loss.isfinite(): continue`): a failure
        click.echo(f"ampdoctor: {script} took no optimizer step: training broke at step {report.diagnosis.step} "
                   "(see the diagnosis above) and no optimizer.step() or GradScaler.update() ran after it (a script "
                   "that skips the step on a non-finite loss never steps).", err=True)
        sys.exit(result.exit_code or EXIT_NEVER_TRAINED)
    if not result.trained:
        click.echo(f"ampdoctor: {script} never trained: no optimizer.step() or GradScaler.update() ran. Check that the "
                   "script runs its training loop with these arguments (pass them after the script name)."
                   + misplaced_options(run, args), err=True)
        sys.exit(result.exit_code or EXIT_NEVER_TRAINED)
    sys.exit(result.exit_code)


def _children(started: Sequence[str]) -> str:
    """``2 child processes (torch.multiprocessing.spawn(worker))``: how many, through what."""
    kinds = list(dict.fromkeys(started))
    return f"{len(started)} child process{'es' if len(started) != 1 else ''} ({', '.join(kinds)})"


def _run_torchrun(script, args, cfg, out_dir: Path, nproc: int, table, json_path, html_path) -> None:
    """``run --nproc-per-node N``: every rank runs the script under its own session."""
    import os
    import subprocess

    from .launch import RESULT_PATTERN, read_rank_results, torchrun_command
    from .report import build_report

    env = dict(os.environ, AMPDOCTOR_CONFIG=cfg.to_env(), AMPDOCTOR_TRIAL_RESULT=str(out_dir / RESULT_PATTERN))
    proc = subprocess.run(torchrun_command(nproc, str(Path(script).resolve()), args), env=env)
    results = read_rank_results(out_dir)
    if not results:
        raise click.ClickException(f"torchrun exited with status {proc.returncode} before any rank ran the script; "
                                   "see its output above")
    report = build_report(out_dir)
    _print_report(report, *table)
    _write_outputs(report, json_path, html_path, None, out_dir)
    click.echo(f"run folder: {out_dir}  ({len(results)} rank trace(s); `ampdoctor report {shlex.quote(str(out_dir))} "
               "--rank N`)")
    r0 = results.get(0, next(iter(results.values())))
    crashed = {r: d for r, d in results.items() if d.get("status") == "crashed"}
    for rank, d in sorted(crashed.items()):
        click.echo(f"ampdoctor: rank {rank} raised {d.get('error')}\n{d.get('traceback') or ''}", err=True)
    if crashed:
        sys.exit(1)
    if r0.get("status") == "stopped":
        sys.exit(0)
    sys.exit(int(r0.get("exit_code") or 0))


@main.command()
@click.argument("path", type=click.Path(), metavar="TRACE_OR_RUN_DIR")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the report as JSON.")
@click.option("--html", "html_path", type=click.Path(dir_okay=False), default=None, help="Write the HTML report.")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), default=None, help="Write the per-layer table as CSV.")
@click.option("--rank", type=click.IntRange(min=0), default=None,
              help="Which rank's trace of a torchrun run: in a run folder, or beside a trace file "
                   "[default: rank 0 of a folder; the file given].")
@_report_options
def report(path, json_path, html_path, csv_path, rank, sort, top, only_bad, match, kinds):
    """Print (and write) the report of a trace file or run folder. Needs only the trace."""
    from .report import build_report
    from .report.model import NoSuchRank

    output_problems(json=json_path, html=html_path, csv=csv_path)
    log = logging.getLogger("ampdoctor.report")
    log.info("ampdoctor: reading %s", path)
    try:
        rep = build_report(path, rank=rank)
    except FileNotFoundError as e:
        raise click.ClickException(str(e) + _trials_hint(Path(path), str(e))) from None
    except NoSuchRank as e:
        raise click.BadParameter(str(e), param_hint="--rank") from None
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    log.info("ampdoctor: trace %s: %d steps in the timeline, %d layer rows, %d events, %d notes%s", rep.trace,
             len(rep.timeline), len(rep.layers), len(rep.events), len(rep.notes),
             ", with a bisect result" if rep.bisect else "")
    _print_report(rep, sort, top, only_bad, match, kinds)
    if not _write_outputs(rep, json_path, html_path, csv_path, None):
        sys.exit(1)


def _trials_hint(folder: Path, message: str) -> str:
    """Where the traces are when a bisect folder has none of its own yet (an interrupted bisect
    copies its baseline's trace only at the end): its trials' folders."""
    trials = folder / "trials"
    if not trials.is_dir() or str(trials) in message:
        return ""
    traces = sorted(trials.glob("*/trace.sqlite"))
    if not traces:
        return f"; this bisect folder holds no trace yet (interrupted?), and no trial under {trials} recorded one"
    return (f"; this bisect folder holds no baseline trace yet (interrupted?): the trials' traces are in "
            f"{trials}/ (e.g. `ampdoctor report {shlex.quote(str(traces[0].parent))}`)")


def _register_bisect() -> None:
    from .bisect.cli import bisect_command

    main.add_command(bisect_command, "bisect")


_register_bisect()
