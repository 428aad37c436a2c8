"""The ``python -m gwenlake_hpc models ...`` sub-commands (list, show, commit, promote, rollback, push,
register): their arguments and what each does. The only place that joins the registry and the release gate."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping

from ..base.errors import ConfigError
from ..base.names import check_alias
from ..stores.registry import (CHAMPION, alias_history, current_aliases, list_models, load_model, mlflow_set_alias,
                               move_alias, register_version, rollback_target, save_model)
from ..stores.versioning import default_model_repo, open_model_repo, push_versions

log = logging.getLogger("gwenlake_hpc.registry")

__all__ = ["default_tracking_uri", "models_command", "add_models_parser"]


def default_tracking_uri(explicit: str | None) -> str | None:
    """Tracking URI for the ``models`` commands: ``--tracking-uri``, else $MLFLOW_TRACKING_URI, else the
    jobs' default store ``./runs/mlflow.db`` when it exists, else None (aliases in git only)."""
    if explicit:
        from ..stores.tracking import validate_uri

        return validate_uri(explicit)
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    db = Path.cwd() / "runs" / "mlflow.db"
    from ..stores.tracking import sqlite_uri

    return sqlite_uri(db) if db.is_file() else None


def _fmt_metrics(metrics: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={v:.4f}" if isinstance(v, (int, float)) else f"{k}={v}" for k, v in sorted(metrics.items()))


def models_command(args: Any) -> int:
    """``python -m gwenlake_hpc models ACTION ...`` (list, show, commit, promote, rollback, push, history);
    returns the exit status. Raises GwenlakeError for the CLI to print."""
    from ..stores.tracking.uri import redact_uri

    repo_path = Path(args.repo) if getattr(args, "repo", None) else default_model_repo(Path.cwd())
    if args.action == "commit":
        sha = save_model(args.directory, args.name, message=args.message, repo=open_model_repo(repo_path, create=True))
        print(f"model {args.name} version {sha}")
        return 0
    repo = open_model_repo(repo_path, create=False)
    if args.action == "list":
        versions = list_models(args.name, repo)
        if not versions:
            print(f"no versions of {args.name} in {repo.working_dir}")
        for v in versions:  # one line per version
            tag = f"  [{', '.join(v['aliases'])}]" if v["aliases"] else ""
            print(f"{v['version']}  {v['date']}{tag}  {v['message'].splitlines()[0] if v['message'] else ''}"
                  f"  | metrics {_fmt_metrics(v['metrics']) or '-'} | run {v['run_id'] or '-'}"
                  f" | data {', '.join(f'{k}={d}' for k, d in sorted(v['datasets'].items())) or '-'}")
        moves = alias_history(args.name, repo) if args.history else []
        if moves:
            print("alias moves (oldest first):")
            for m in moves:
                print(f"  {m['when']}  {m['alias']}: {(m['previous'] or 'unset')[:12]} -> {m['version'][:12]}  "
                      f"{m['action']} by {m['who']}" + (f": {m['reason']}" if m["reason"] else ""))
        return 0
    if args.action == "show":
        m = load_model(args.name, args.version, alias=args.alias, repo=repo)
        print(f"model {m.name} version {m.version}\n  path: {m.path}\n  metrics: {_fmt_metrics(m.metrics)}")
        print(f"  files: {', '.join(sorted(str(p.relative_to(m.path)) for p in m.path.rglob('*') if p.is_file()))}")
        print(f"  lineage: {json.dumps(m.lineage, indent=2, sort_keys=True, default=str)}")
        return 0
    if args.action == "push":
        refs = push_versions(repo, args.name, args.remote)
        print(f"pushed {', '.join(refs)} to {redact_uri(args.remote)}")
        return 0
    uri = default_tracking_uri(getattr(args, "tracking_uri", None))
    if args.action == "register":
        m = load_model(args.name, args.version, repo=repo)
        tracking = m.lineage.get("tracking") or {}
        run_id = tracking.get("run_id")
        if not run_id and tracking.get("state_dir"):  # committed before its MLflow run was attached
            run_file = Path(tracking["state_dir"]) / "run_id"
            run_id = run_file.read_text().strip() if run_file.is_file() else None
        if not uri or not run_id:
            raise ConfigError(f"version {m.version[:12]} of {args.name} has no tracking run or no tracking URI is "
                              "known (--tracking-uri URI or MLFLOW_TRACKING_URI); registration needs both")
        number = register_version(uri, args.name, m.version, run_id, m.path,
                                  {"gwenlake.code_commit": str((m.lineage.get("code") or {}).get("commit"))})
        for alias, sha in current_aliases(args.name, repo).items():
            if sha == m.version:  # the git aliases of this version, now that MLflow knows it
                mlflow_set_alias(uri, args.name, alias, sha)
        print(f"registered {args.name} version {m.version} as MLflow model version {number}")
        return 0
    if args.action == "promote":
        from ..release.gate import find_run_dir, promote, version_from_run

        version = args.version
        check_alias(args.alias)  # before any gate or commit
        if args.criterion and not args.from_run:
            raise ConfigError("--criterion picks among a run's checkpoints: give --from-run RUN with it")
        if args.from_run:
            run_dir = find_run_dir(Path(args.runs_root), args.name, args.from_run)
            version = version_from_run(args.name, run_dir, args.criterion, repo=repo)
        return promote(args.name, version, args.alias, repo=repo, reason=args.reason or "",
                       config=args.config, data_root=Path(args.data_root), tracking_uri=uri, force=False)
    if args.action == "rollback":
        current, previous = rollback_target(args.name, args.alias, repo)
        move_alias(args.name, args.alias, previous, repo=repo, action="rollback", expected=current,
                   reason=args.reason or f"rollback from {current[:12]}")
        if uri:
            try:
                mlflow_set_alias(uri, args.name, args.alias, previous)
            except Exception as exc:  # noqa: BLE001 - git holds the truth; say MLflow lags
                log.warning("alias moved in git, but not in MLflow (%s): %s", redact_uri(uri), exc)
        print(f"alias {args.alias} of {args.name}: {current} -> {previous} (rolled back)")
        return 0
    raise ConfigError(f"unknown models action {args.action!r}")


def add_models_parser(sub: Any) -> None:
    """Add the ``models`` sub-command and its actions to an argparse sub-parsers object."""
    models = sub.add_parser("models", help="model versions, aliases and release").add_subparsers(
        dest="action", required=True)

    def common(p: Any) -> Any:
        p.add_argument("name", help="model name group.name")
        p.add_argument("--repo", help="model repository (paths.model_repo; default: the git repository here)")
        return p

    ls = common(models.add_parser("list", help="versions (commit, date, aliases, metrics, tracking run, datasets)"))
    ls.add_argument("--history", action="store_true", help="also every alias move (who, when, from, to, why)")
    sh = common(models.add_parser("show", help="one version: files, metrics, lineage"))
    sh.add_argument("version", nargs="?", help="commit SHA (default: the newest)")
    sh.add_argument("--alias", help="an alias instead of a SHA, e.g. champion")
    cm = models.add_parser("commit", help="commit a directory as a new version of a model (work done by hand)")
    cm.add_argument("directory")
    common(cm)
    cm.add_argument("-m", "--message", default=None)
    pr = common(models.add_parser("promote", help="run the release gate, then move an alias to a version"))
    which = pr.add_mutually_exclusive_group(required=True)
    which.add_argument("--version", help="commit SHA of the version to promote")
    which.add_argument("--from-run", help="a run (run key or MLflow run id): its own version, or with --criterion "
                                          "the best of its checkpoints (committed as a version first)")
    pr.add_argument("--criterion", help="with --from-run: max:METRIC or min:METRIC over the checkpoints' metrics")
    pr.add_argument("--runs-root", default="runs", help="paths.runs_root holding the run (default ./runs)")
    pr.add_argument("--alias", default=CHAMPION, help="alias to move (default champion)")
    pr.add_argument("--reason", help="why (recorded in the alias log)")
    pr.add_argument("--config", help="release config: a YAML path or a name in conf/release/ (default: the one "
                                     "whose 'model' is NAME)")
    pr.add_argument("--data-root", default="data", help="catalog root (paths.data_root), default ./data")
    pr.add_argument("--tracking-uri", help="MLflow URI to mirror the alias (default: $MLFLOW_TRACKING_URI, "
                                           "else ./runs/mlflow.db when present)")
    rb = common(models.add_parser("rollback", help="move an alias back to its previous version"))
    rb.add_argument("--alias", default=CHAMPION)
    rb.add_argument("--reason")
    rb.add_argument("--tracking-uri")
    ps = common(models.add_parser("push", help="push a model's versions and aliases (LFS objects included)"))
    ps.add_argument("remote", help="remote name, URL, or path of a bare repository")
    rg = common(models.add_parser("register", help="register a version in the MLflow Model Registry"))
    rg.add_argument("version")
    rg.add_argument("--tracking-uri")
