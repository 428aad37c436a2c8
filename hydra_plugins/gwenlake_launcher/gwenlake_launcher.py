"""A Hydra launcher on submitit, shaped like hydra-submitit-launcher, with gwenlake's requeue handling.

``python -m gwenlake_hpc -m +job=churn launcher=slurm job.params.lr=1e-3,3e-4,1e-4`` selects it
(``hydra/launcher=gwenlake_slurm``): every task of the sweep is planned (its own run directory, keyed by its
config, not by job id, so a requeued task finds its checkpoints), then all are submitted with one ``sbatch``
as a job array. It does not block on the first failed task: with ``launcher.wait=true`` it waits for all of
them and prints a table of each task's overrides, state, restarts and metrics.
"""

# No `from __future__ import annotations`: Hydra's plugin scan imports this module outside sys.modules,
# where dataclasses cannot resolve string annotations.
import logging
import pickle
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper  # no public base for a sweeper that launches
from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus, filter_overrides, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict

log = logging.getLogger("gwenlake_hpc.launch.sweep")


@dataclass
class GwenlakeSlurmLauncherConf:
    _target_: str = "hydra_plugins.gwenlake_launcher.gwenlake_launcher.GwenlakeSlurmLauncher"


ConfigStore.instance().store(group="hydra/launcher", name="gwenlake_slurm", node=GwenlakeSlurmLauncherConf,
                             provider="gwenlake_hpc")


@dataclass
class GwenlakeSweeperConf:
    _target_: str = "hydra_plugins.gwenlake_launcher.gwenlake_launcher.GwenlakeSweeper"
    max_batch_size: Optional[int] = None
    params: Optional[Dict[str, str]] = None


ConfigStore.instance().store(group="hydra/sweeper", name="gwenlake_basic", node=GwenlakeSweeperConf,
                             provider="gwenlake_hpc")


class GwenlakeSweeper(BasicSweeper):
    """Hydra's basic sweeper without its check that composes every task's config before the launch.

    That check composed each task a first time (about half a second each: two minutes for 256 points) before
    the launcher composed it again. :class:`GwenlakeSlurmLauncher` composes (or derives) and plans every task
    before it submits anything, so a bad task still stops the sweep with nothing submitted.
    """

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:  # noqa: D401 - see class
        return None


_SIMPLE = re.compile(r"^([A-Za-z_][\w.]*)=([\w.+-]*)$")
_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")
_WORD = re.compile(r"^[A-Za-z][A-Za-z0-9-]*$")


def _simple_value(raw: str) -> Any:
    """The value Hydra's override grammar gives a plain number, word, true/false/null; _NOT_SIMPLE otherwise."""
    low = raw.lower()
    if low == "null":
        return None
    if low in ("true", "false"):
        return low == "true"
    if low in ("inf", "+inf", "-inf", "nan"):
        return float(low)
    if _NUMBER.match(raw):
        return int(raw) if re.fullmatch(r"[+-]?\d+", raw) else float(raw)
    if _WORD.match(raw):
        return raw
    return _NOT_SIMPLE


_NOT_SIMPLE = object()


class TaskDeriver:
    """Derives sweep task configs from the first task's (``base``, composed by Hydra with ``base_overrides``).

    A task whose overrides differ from the first's only by values of keys that exist in it is that config
    (without its ``hydra`` node, which the job never reads) with those values set: a copy of a few hundred
    nodes and a few assignments checked by the same schema, instead of a composition (about half a second).
    """

    def __init__(self, base: DictConfig, base_overrides: Sequence[str]) -> None:
        from omegaconf import OmegaConf

        self.light = OmegaConf.masked_copy(base, [k for k in base.keys() if k != "hydra"])
        # a task's copy is unpickled from these bytes: a fifth of the time of copy.deepcopy, the same nodes
        self._pickled = pickle.dumps(self.light, protocol=pickle.HIGHEST_PROTOCOL)
        self.base_lines = {line.split("=", 1)[0]: line for line in base_overrides}
        self.base_keys = [line.split("=", 1)[0] for line in base_overrides]

    def derive(self, overrides: Sequence[str]) -> Optional[DictConfig]:
        """The task's config, or None when Hydra must compose it (another key set, a config group, an added or
        deleted key, a value the schema refuses)."""
        from omegaconf import OmegaConf
        from omegaconf.errors import OmegaConfBaseException

        if [line.split("=", 1)[0] for line in overrides] != self.base_keys:
            return None
        changes = []
        for line in overrides:
            key = line.split("=", 1)[0]
            if line == self.base_lines[key]:
                continue
            m = _SIMPLE.match(line)
            value = _simple_value(m.group(2)) if m else _NOT_SIMPLE
            if value is _NOT_SIMPLE:
                value = self._parsed_value(line)
                if value is _NOT_SIMPLE:
                    return None
            node = OmegaConf.select(self.light, key, default=None, throw_on_missing=False)
            if key.startswith(("hydra", "+", "~")) or "/" in key or isinstance(node, DictConfig) \
                    or OmegaConf.is_list(node):
                return None
            changes.append((key, value))
        cfg = pickle.loads(self._pickled)
        try:
            for key, value in changes:
                OmegaConf.update(cfg, key, value, merge=False)  # typed nodes refuse a wrong value
        except (OmegaConfBaseException, ValueError, TypeError):
            return None
        return cfg

    @staticmethod
    def _parsed_value(line: str) -> Any:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        try:
            (o,) = OverridesParser.create().parse_overrides([line])
        except Exception:  # noqa: BLE001 - Hydra reports it when it composes
            return _NOT_SIMPLE
        if o.is_add() or o.is_delete() or o.is_force_add() or o.is_sweep_override() or o.package is not None:
            return _NOT_SIMPLE
        return o.value()


def derive_task_config(base: DictConfig, base_overrides: Sequence[str], overrides: Sequence[str]) -> Optional[DictConfig]:
    """:meth:`TaskDeriver.derive` for one task (see there)."""
    return TaskDeriver(base, base_overrides).derive(overrides)


class GwenlakeSlurmLauncher(Launcher):
    """Submits a Hydra sweep as one SLURM job array (see module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.config: Optional[DictConfig] = None
        self.hydra_context: Optional[HydraContext] = None
        self.task_function: Optional[TaskFunction] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from gwenlake_hpc.base.errors import GwenlakeError
        from gwenlake_hpc.launch.sweep import submit_array

        setup_globals()
        assert self.config is not None and self.hydra_context is not None
        configs = []
        deriver: Optional[TaskDeriver] = None
        task_name = "gwenlake"
        for idx, overrides in enumerate(job_overrides):
            # Hydra composes every task from scratch (about half a second each): a task that differs from the
            # first only by values of existing keys is that config with those values set, checked against
            # the same schema; anything else (a config group, +key, ~key) is composed by Hydra.
            cfg = deriver.derive(list(overrides)) if deriver is not None else None
            if cfg is None:
                cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
                with open_dict(cfg):
                    cfg.hydra.job.id = initial_job_idx + idx
                    cfg.hydra.job.num = initial_job_idx + idx
                if deriver is None:
                    deriver, task_name = TaskDeriver(cfg, list(overrides)), str(cfg.hydra.job.name)
            configs.append((list(filter_overrides(overrides)), cfg))
        try:
            tasks = submit_array(configs)
        except GwenlakeError as exc:  # a bad task or sbatch refusing: its message, not a traceback; nothing submitted
            print(f"error: {exc}", file=sys.stderr)
            raise SystemExit(exc.exit_code) from None
        returns: List[JobReturn] = []
        for (overrides, cfg), task in zip(configs, tasks):
            # With launcher.wait, a task that did not complete is FAILED (its state in the error). Without it a
            # task is only submitted: Hydra has no status for that (UNKNOWN would stop its sweeper), so it is
            # COMPLETED for Hydra, and the task's own record says "state": absent, the table SUBMITTED.
            failed = task.get("state") not in (None, "COMPLETED")
            ret = JobReturn(overrides=overrides, cfg=cfg, hydra_cfg=cfg, working_dir=str(Path.cwd()), task_name=task_name,
                            status=JobStatus.FAILED if failed else JobStatus.COMPLETED)
            ret.return_value = RuntimeError(f"task {task['job_id']} ended {task['state']}") if failed else task
            returns.append(ret)
        return returns
