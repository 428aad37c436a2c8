"""Command lines: ``python -m gwenlake_hpc`` (Hydra jobs and sub-commands) and ``gwenlake-train``.

Sub-commands (``data``, ``tracking``, ``models``) are dispatched before Hydra reads the command line, so
``python -m gwenlake_hpc tracking sync DIR`` is not parsed as an override.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Sequence

from ..base.errors import EXIT_EVICTED, EXIT_USAGE, GwenlakeError
from ..runtime.signals import StopInterrupt, ignore_from_now_on, install_early

log = logging.getLogger("gwenlake_hpc.cli")

SUBCOMMANDS = ("data", "tracking", "models", "status", "cancel", "logs", "report", "checkpoints")

# MLflow configures its own loggers at import (INFO: "Creating initial MLflow database tables..."); its
# environment variable is the one setting it reads at that moment.
os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")


def _setup_logging() -> None:
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s",
                            stream=sys.stderr)
    # MLflow and alembic are chatty at INFO when a store is created.
    for noisy in ("alembic", "mlflow"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


# --- sub-commands ----------------------------------------------------------------------------------------------

def _subcommand_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gwenlake_hpc", description=(
        "Run a training job (python -m gwenlake_hpc +job=NAME [overrides]) or a sub-command."))
    sub = p.add_subparsers(dest="command", required=True)

    data = sub.add_parser("data", help="datasets in the catalog").add_subparsers(dest="action", required=True)
    imp = data.add_parser("import", help="turn a CSV or Parquet file into a catalog dataset (HDF5)")
    imp.add_argument("source", help="a .csv, .parquet or .pq file")
    imp.add_argument("name", help="dataset name group.name, e.g. crm.churn-train")
    imp.add_argument("--data-root", default="data", help="catalog root (paths.data_root), default ./data")
    imp.add_argument("--columns", help="comma-separated columns to keep (default: all)")
    imp.add_argument("--force", action="store_true", help="replace the dataset if it exists (a new revision)")
    show = data.add_parser("show", help="print a dataset's rows, columns and revision")
    show.add_argument("name")
    show.add_argument("--data-root", default="data")

    tr = sub.add_parser("tracking", help="MLflow tracking").add_subparsers(dest="action", required=True)
    sync = tr.add_parser("sync", help="deliver metric points a job could not deliver, then its final status")
    sync.add_argument("run_dir", help="the run directory (<runs_root>/<model>/<run key>), or one of its "
                                      "tracking state folders (tracking-<hash> after a change of tracking.uri)")
    sync.add_argument("--uri", help="tracking URI to deliver to (default: the one the job used)")
    sync.add_argument("--timeout", type=float, default=60.0, help="seconds to keep trying (default 60)")

    from .models import add_models_parser

    add_models_parser(sub)  # list, show, commit, promote, rollback, push, register
    ck = sub.add_parser("checkpoints", help="named checkpoints of a model").add_subparsers(dest="action",
                                                                                          required=True)
    ckl = ck.add_parser("list", help="name, run, step, metadata, size and date of each named checkpoint")
    ckl.add_argument("model", help="the model's name, e.g. crm.churn")
    ckl.add_argument("--runs-root", default="runs", help="paths.runs_root (default ./runs)")
    rp = sub.add_parser("report", help="PNG of a run's metric curves with each restart marked")
    rp.add_argument("run_dir", help="the run directory (<runs_root>/<model>/<run key>)")
    rp.add_argument("--out", help="PNG path (default <run_dir>/report.png)")
    rp.add_argument("--uri", help="tracking URI (default: the one the job used)")
    from .report import SMOOTHING  # light: matplotlib and MLflow are imported when a report is drawn

    rp.add_argument("--smoothing", type=float, default=SMOOTHING, metavar="WEIGHT",
                    help="EMA weight in [0, 1) of the smoothed curves drawn over the faint raw ones, as "
                         f"TensorBoard's (default {SMOOTHING}; 0: raw curves only)")
    st = sub.add_parser("status", help="jobs submitted from here: state, restarts, step, checkpoint, MLflow run")
    st.add_argument("--runs-root", default="runs", help="paths.runs_root (default ./runs)")
    st.add_argument("--all", action="store_true", help="also jobs that ended more than a day ago")
    cn = sub.add_parser("cancel", help="scancel a job (its checkpoints are kept; a later identical job resumes)")
    cn.add_argument("job_id")
    cn.add_argument("--runs-root", default="runs", help="paths.runs_root whose job index names the job's cluster")
    lg = sub.add_parser("logs", help="print a job's log")
    lg.add_argument("job_id")
    lg.add_argument("--runs-root", default="runs")
    lg.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until the job ends")
    lg.add_argument("--stderr", action="store_true", help="the error log instead of the output log")
    return p


def run_subcommand(argv: Sequence[str]) -> int:
    """Run ``data``/``tracking``/``models`` sub-commands; returns the exit status."""
    args = _subcommand_parser().parse_args(list(argv))
    try:
        if args.command == "data":
            from ..stores.data import Catalog

            catalog = Catalog(args.data_root)
            if args.action == "import":
                if catalog.exists(args.name) and not args.force:
                    print(f"error: dataset {args.name} exists at {catalog.path(args.name)}; add --force to replace "
                          "it (runs keyed to its old revision keep their checkpoints)", file=sys.stderr)
                    return EXIT_USAGE
                cols = [c.strip() for c in args.columns.split(",")] if args.columns else None
                rev = catalog.import_table(args.source, args.name, columns=cols)
                ds = catalog.open(args.name)
                print(f"dataset {args.name}: {ds.rows} rows, columns {', '.join(ds.columns)}, revision {rev}")
                print(f"path {ds.path}")
            else:
                ds = catalog.open(args.name)
                print(f"dataset {args.name}: {ds.rows} rows, revision {ds.revision}, path {ds.path}")
                for col, (dtype, shape) in ds.schema.items():
                    print(f"  {col}: {dtype} {list(shape)}")
            return 0
        if args.command == "checkpoints":
            return _list_named_checkpoints(Path(args.runs_root), args.model)
        if args.command == "report":
            from .report import report

            out, marks = report(args.run_dir, args.out, args.uri, smoothing=args.smoothing)
            print(f"wrote {out} ({len(marks)} restart(s) marked at steps {marks}; smoothing {args.smoothing + 0.0:g})")
            return 0
        if args.command in ("status", "cancel", "logs"):
            from ..launch import commands

            if args.command == "status":
                return commands.print_status(Path(args.runs_root), include_old=args.all)
            if args.command == "cancel":
                return commands.cancel(args.job_id, Path(args.runs_root))
            return commands.print_logs(Path(args.runs_root), args.job_id, follow=args.follow,
                                           stderr=args.stderr)
        if args.command == "tracking":
            from ..stores.tracking import sync as tracking_sync

            target = Path(args.run_dir)
            state = target if (target / "tracking.json").exists() else target / "tracking"
            res = tracking_sync(state, uri=args.uri, timeout_s=args.timeout)
            print(f"run {res['run_id']}: delivered {res['delivered']} points, {res['remaining']} remaining, "
                  f"status {res['status'] or 'unchanged'}")
            from ..stores.registry import PENDING_REGISTRATIONS, complete_pending_registrations

            pending = (state / PENDING_REGISTRATIONS).is_file()
            if pending:
                from ..stores.tracking import validate_uri

                uri = args.uri or (json.loads((state / "tracking.json").read_text()).get("uri"))
                for version in complete_pending_registrations(state, validate_uri(uri)):
                    print(f"registered version {version}")
            left = (state / PENDING_REGISTRATIONS).is_file()
            return 0 if res["remaining"] == 0 and not left else 1
        if args.command == "models":
            from .models import models_command

            return models_command(args)
    except GwenlakeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return EXIT_USAGE


def _list_named_checkpoints(runs_root: Path, model: str) -> int:
    """``checkpoints list MODEL``: one line each, oldest first, ``*`` marking ``latest``."""
    import datetime

    from ..base.names import check_name
    from ..stores.checkpoints.named import list_named

    check_name(model, "model")
    items = list_named(runs_root / model)
    if not items:
        print(f"no named checkpoint of {model} in {runs_root / model / 'named'}")
        return 0
    print(f"{'':1} {'name':<24} {'run':<28} {'step':>9} {'size':>10}  {'date (UTC)':<19}  metadata")
    for i in items:
        date = datetime.datetime.fromtimestamp(float(i.get("time", 0)), datetime.timezone.utc)
        print(f"{'*' if i['latest'] else ' '} {i['name']:<24} {i.get('run_key', '?'):<28} {i.get('step', 0):>9} "
              f"{i['size']:>10}  {date:%Y-%m-%d %H:%M:%S}  {json.dumps(i.get('metadata') or {}, sort_keys=True)}")
    return 0


# --- Hydra jobs --------------------------------------------------------------------------------------------------

def run_hydra(argv: Sequence[str]) -> int:
    """Compose the config with Hydra from ``argv`` and run the job; returns the exit status.

    Hydra reports its own composition errors (unknown job, unknown key, wrong type) and exits 1; those are
    mapped to 2, since they are usage errors. The job's own statuses pass through unchanged.
    """
    import hydra

    from ..job.config import conf_dir, register
    from ..job.config_files import settable_launcher_overrides

    register()
    state = {"started": False, "code": 0}

    @hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")
    def _task(cfg) -> None:  # type: ignore[no-untyped-def]
        state["started"] = True
        state["code"] = _run_task(cfg)

    argv = list(argv)
    refused = _refuse_before_hydra(argv, conf_dir())
    if refused is not None:
        return refused
    argv = settable_launcher_overrides(argv, conf_dir())
    _choose_sweep_launcher(argv)
    saved = sys.argv
    sys.argv = [saved[0] if saved else "gwenlake_hpc", *argv]
    if "gwenlake_hpc.launch.sweep" in sys.modules:
        sys.modules["gwenlake_hpc.launch.sweep"].LAST_SWEEP = None  # type: ignore[attr-defined]
    try:
        _task()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if _swept() is not None:
            return int(_swept())  # type: ignore[arg-type]
        if not state["started"] and code == 1:
            return EXIT_USAGE
        return code if not state["started"] else (state["code"] or code)
    finally:
        sys.argv = saved
    return int(state["code"]) if _swept() is None else int(_swept())  # type: ignore[arg-type]


def _run_task(cfg) -> int:  # type: ignore[no-untyped-def]
    """The Hydra task of a composed config: its keys checked, then submitted over SSH (``cluster=``), to SLURM
    (``launcher=slurm``) or run here; returns the exit status."""
    from ..job.config_files import check_keys
    from ..job.execute import execute
    from ..runtime.signals import process_stop, release_early

    _setup_logging()
    try:  # here, not at planning: a cluster= job is planned on the cluster, after the transfer
        check_keys(cfg)
    except GwenlakeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    submits = cfg.get("cluster") is not None or cfg.launcher.get("name") == "slurm"
    if submits:  # Ctrl-C must interrupt a submission or its wait at once
        early = release_early()
        if early is not None and early.signum is not None:
            return 128 + int(early.signum)
    if cfg.get("cluster") is not None:  # cluster=NAME: submit over SSH (launch/remote.py)
        from ..launch.remote import cli_submit

        return cli_submit(cfg)
    if cfg.launcher.get("name") == "slurm":
        return _submit_slurm(cfg)
    return execute(cfg, stop=process_stop()).exit_code


def _refuse_before_hydra(argv: Sequence[str], conf: Path) -> int | None:
    """The exit status of a command line refused before Hydra reads it (the reason printed), or None.

    What Hydra would report with a traceback or without naming the key: an unquoted non-ASCII value, a
    ``GROUP=null``, a broken config file (:func:`gwenlake_hpc.job.config_files.check_group_choices`), a
    mistyped key or a value of the wrong type in a plain override (:func:`~gwenlake_hpc.job.config_files.check_overrides`).
    """
    from ..job.config_files import check_group_choices, check_overrides

    for arg in argv:  # Hydra's lexer refuses unquoted non-ASCII values with no hint: say how to quote them
        key, eq, value = arg.partition("=")
        if eq and not value.startswith(("'", '"')) and not value.isascii():
            print(f"error: {arg}: Hydra's override grammar takes non-ASCII characters only inside quotes; write "
                  f"{key}='{value}' (in a shell: \"{key}='{value}'\")", file=sys.stderr)
            return EXIT_USAGE
    try:
        check_group_choices(argv, conf)
        check_overrides(argv)
    except GwenlakeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return None


def _choose_sweep_launcher(argv: list[str]) -> None:
    """A ``-m launcher=slurm`` sweep becomes one job array: our Hydra launcher and sweeper are added to ``argv``."""
    from ..runtime.signals import release_early

    if ("-m" in argv or "--multirun" in argv) and "launcher=slurm" in argv \
            and not any(a.startswith("hydra/launcher=") for a in argv):
        argv.append("hydra/launcher=gwenlake_slurm")  # the sweep becomes one job array
        if not any(a.startswith("hydra/sweeper=") for a in argv):
            argv.append("hydra/sweeper=gwenlake_basic")  # the launcher checks every task: no composition twice
    if any(a.startswith("hydra/launcher=") for a in argv):
        release_early()  # a launcher plug-in submits (and may wait): Ctrl-C must interrupt it at once


def _swept() -> int | None:
    """A sweep submitted as a job array (the launcher plug-in imported the module): its tasks' exit status."""
    sweep = sys.modules.get("gwenlake_hpc.launch.sweep")
    tasks = getattr(sweep, "LAST_SWEEP", None)
    return None if tasks is None else sweep.sweep_exit_status(tasks)  # type: ignore[union-attr]


def _submit_slurm(cfg) -> int:  # type: ignore[no-untyped-def]
    """``launcher=slurm``: submit, print the job id, logs and run directory; with ``wait``, block."""
    from ..launch import status as slurm_status
    from ..launch.slurm import submit

    try:
        sub = submit(cfg)
    except GwenlakeError as exc:
        log.error("%s", exc)
        return exc.exit_code
    if sub is None:
        return 0
    print(f"submitted job {sub.job_id}\n  run directory {sub.run_dir}\n  stdout {sub.stdout}\n  stderr {sub.stderr}",
          flush=True)
    if not cfg.launcher.get("wait"):
        return 0
    final = slurm_status.wait(sub.job_id, sub.run_dir)
    print(f"job {sub.job_id}: {final.state}" + (f", model version {final.version}" if final.version else ""))
    return 0 if final.state == "COMPLETED" else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m gwenlake_hpc``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        _setup_logging()
        return run_subcommand(argv)
    install_early()  # before Hydra and torch load: no stop signal may kill a training on its way in or out
    try:
        return run_hydra(argv)
    except StopInterrupt as exc:  # during the start-up (Hydra, imports): ends at once, as evicted
        print(f"stop requested ({exc}) during the start-up: nothing trained; run the same command again to "
              "resume", file=sys.stderr, flush=True)
        return EXIT_EVICTED
    finally:
        ignore_from_now_on()


# --- gwenlake-train ------------------------------------------------------------------------------------------------

_SKIP_DIRS = {".git", ".venv", "venv", "env", "__pycache__", "site-packages", "node_modules", "runs", "data",
              "models", "outputs", "multirun", "build", "dist", "tests", "gwenlake_hpc"}


def discover(root: Path, skipped: dict[str, str] | None = None) -> dict[str, "object"]:
    """Import the Python files under ``root`` that use ``@train`` and return the decorated functions.

    Only files whose text mentions both ``gwenlake_hpc`` and ``@train`` are imported, so scanning a project
    does not run its other scripts. Files that fail to import are reported and skipped.

    Returns:
        target (``path.py:function``) -> TrainFunction. Targets that failed to load go into ``skipped``
        (target -> reason) when given.
    """
    from ..authoring.api import TrainFunction
    from ..job.plan import load_target

    found: dict[str, object] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for fn in sorted(filenames):
            if not fn.endswith(".py"):
                continue
            path = Path(dirpath) / fn
            try:
                text = path.read_text(errors="replace")
            except OSError:
                continue
            if "gwenlake_hpc" not in text or "@train" not in text:
                continue
            names = _decorated_functions(text)
            module = _dotted_module(path, root)
            rel = os.path.relpath(path, Path.cwd())
            for name in names:
                # Inside a package: import by module name, so its relative imports work.
                target = f"{module}:{name}" if module else f"{rel}:{name}"
                try:
                    tf = load_target(target)
                except Exception as exc:  # a broken file must not hide the others
                    log.warning("skipping %s: %s", target, exc)
                    if skipped is not None:
                        skipped[target] = str(exc)
                    continue
                if isinstance(tf, TrainFunction):
                    found[target] = tf
    return found


def _decorated_functions(text: str) -> list[str]:
    """Names of the module-level functions of ``text`` decorated with ``@train(...)`` (or ``@gwenlake_hpc.train``),
    by its syntax tree: a ``@train`` inside a string (a template) is not one. A file that does not parse is
    matched by its text, so that importing it reports the error."""
    import ast

    try:
        tree = ast.parse(text)
    except SyntaxError:
        return re.findall(r"^@train\([\s\S]*?\)\s*\ndef\s+(\w+)", text, re.M)

    def is_train(d: ast.expr) -> bool:
        d = d.func if isinstance(d, ast.Call) else d
        return (isinstance(d, ast.Name) and d.id == "train") or (isinstance(d, ast.Attribute) and d.attr == "train")

    return [n.name for n in tree.body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(map(is_train, n.decorator_list))]


def _dotted_module(path: Path, root: Path) -> str | None:
    """``examples.churn`` for ``<root>/examples/churn.py`` when every folder up to root is a package."""
    rel = path.resolve().relative_to(root.resolve())
    parts = list(rel.parts[:-1])
    if not parts:
        return None
    for i in range(len(parts)):
        if not (root.joinpath(*parts[: i + 1]) / "__init__.py").is_file():
            return None
    return ".".join([*parts, rel.stem])


def train_entry() -> None:
    """The ``gwenlake-train`` console script: :func:`train_main`, then the process's exit (a failed rank of a
    multi-task run ends without gloo's abort at finalisation: :func:`~gwenlake_hpc.runtime.distributed.exit_process`)."""
    from ..runtime.distributed import exit_process

    exit_process(train_main())


def train_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``gwenlake-train``: list or run decorated functions found under the current directory."""
    install_early()
    try:
        return _train_main(argv)
    except StopInterrupt as exc:  # while the project's modules import, or Hydra composes: at once, as evicted
        print(f"stop requested ({exc}) during the start-up: nothing trained; run the same command again to "
              "resume", file=sys.stderr, flush=True)
        return EXIT_EVICTED


def _train_main(argv: Sequence[str] | None) -> int:
    _setup_logging()
    p = argparse.ArgumentParser(prog="gwenlake-train", description=(
        "Find @train functions under the current directory, list them, or run one locally. "
        "Interrupt a run (Ctrl-C) and start it again: it resumes from its last checkpoint."))
    p.add_argument("name", nargs="?", help="function name, or path.py:function (needed when several exist)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. job.params.lr=1e-3 paths.runs_root=/scratch/runs")
    p.add_argument("--list", action="store_true", help="list the training functions found")
    p.add_argument("--steps", type=int, help="total steps (job.steps)")
    p.add_argument("--epochs", type=int, help="epochs (job.epochs)")
    p.add_argument("--eval-every", type=int, help="steps between evaluations (job.eval_every)")
    p.add_argument("--seed", type=int, help="seed (job.seed)")
    p.add_argument("--root", default=".", help="directory to search (default: current directory)")
    # Intermixed: overrides may come after flags (gwenlake-train fit --steps 500 paths.runs_root=X).
    args = p.parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))

    skipped: dict[str, str] = {}
    found = discover(Path(args.root), skipped)
    if args.list:
        if not found:
            print("no @train functions found under", Path(args.root).resolve())
        for target, tf in found.items():
            d = tf.defaults  # type: ignore[attr-defined]
            length = f"steps={d['steps']}" if d.get("steps") else f"epochs={d.get('epochs')}"
            kind = "short fit" if hasattr(tf, "user_fn") else f"{length} eval_every={d['eval_every']}"
            print(f"{target}  -> {tf.output.name}  {kind}")  # type: ignore[attr-defined]
        return 0
    if args.name and ":" in args.name:
        matches = [args.name]
    else:
        matches = [t for t in found if args.name is None or t.rsplit(":", 1)[1] == args.name]
    broken = [t for t in skipped if args.name and (t == args.name or t.rsplit(":", 1)[1] == args.name)]
    if not matches and broken:
        print(f"error: {skipped[broken[0]]}", file=sys.stderr)
        return EXIT_USAGE
    if len(matches) != 1:
        choices = ", ".join(found) or "none"
        print(f"error: {'no' if not matches else 'several'} training functions match "
              f"{args.name or '(no name given)'}; found: {choices}", file=sys.stderr)
        return EXIT_USAGE
    overrides = [f"job.target={matches[0]}", *args.overrides]
    for flag, key in (("steps", "steps"), ("epochs", "epochs"), ("eval_every", "eval_every"), ("seed", "seed")):
        if getattr(args, flag) is not None:
            overrides.append(f"job.{key}={getattr(args, flag)}")
    try:
        return run_hydra(overrides)
    finally:
        ignore_from_now_on()
