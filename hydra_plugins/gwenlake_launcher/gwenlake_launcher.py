"""A Hydra launcher on submitit, shaped like hydra-submitit-launcher, with gwenlake's requeue handling.

``python -m gwenlake_hpc -m +job=churn launcher=slurm job.params.lr=1e-3,3e-4,1e-4`` selects it
(``hydra/launcher=gwenlake_slurm``): every task of the sweep is planned (its own run directory, keyed by its
config, not by job id, so a requeued task finds its checkpoints), then all are submitted with one ``sbatch``
as a job array. It does not block on the first failed task: with ``launcher.wait=true`` it waits for all of
them and prints a table of each task's overrides, state, restarts and metrics.
"""

# No `from __future__ import annotations`: Hydra's plugin scan imports this module outside sys.modules,
# where dataclasses cannot resolve string annotations.
import copy
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

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


def derive_task_config(base: DictConfig, base_overrides: Sequence[str], overrides: Sequence[str]) -> Optional[DictConfig]:
    """The config of a sweep task from the first task's (``base``, composed by Hydra with ``base_overrides``) when
    ``overrides`` only change values of keys that exist in it; None when Hydra must compose it (another key set,
    a config group, an added or deleted key, a value the schema refuses)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf, read_write
    from omegaconf.errors import OmegaConfBaseException

    parser = OverridesParser.create()
    try:
        before = {o.key_or_group: o for o in parser.parse_overrides(list(base_overrides))}
        after = {o.key_or_group: o for o in parser.parse_overrides(list(overrides))}
    except Exception:  # noqa: BLE001 - Hydra reports it when it composes
        return None
    if before.keys() != after.keys():
        return None
    cfg = copy.deepcopy(base)
    for key, o in after.items():
        if o.input_line == before[key].input_line:
            continue
        if o.is_add() or o.is_delete() or o.is_force_add() or o.is_sweep_override() or o.package is not None:
            return None
        node = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
        if "/" in key or key.startswith("hydra") or isinstance(node, DictConfig) or OmegaConf.is_list(node):
            return None
        try:
            OmegaConf.update(cfg, key, o.value(), merge=False)  # typed nodes refuse a wrong value
        except (OmegaConfBaseException, ValueError, TypeError):
            return None
    with read_write(cfg.hydra), open_dict(cfg.hydra):
        cfg.hydra.overrides.task = list(overrides)
    return cfg


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
        from gwenlake_hpc.errors import GwenlakeError
        from gwenlake_hpc.launch.sweep import submit_array

        setup_globals()
        assert self.config is not None and self.hydra_context is not None
        configs = []
        base: Optional[DictConfig] = None
        base_overrides: List[str] = []
        for idx, overrides in enumerate(job_overrides):
            # Hydra composes every task from scratch (about half a second each): a task that differs from the
            # first only by values of existing keys is that config with those values set, checked against
            # the same schema; anything else (a config group, +key, ~key) is composed by Hydra.
            cfg = derive_task_config(base, base_overrides, list(overrides)) if base is not None else None
            if cfg is None:
                cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
                if base is None:
                    base, base_overrides = copy.deepcopy(cfg), list(overrides)
            with open_dict(cfg):
                cfg.hydra.job.id = initial_job_idx + idx
                cfg.hydra.job.num = initial_job_idx + idx
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
            ret = JobReturn(overrides=overrides, cfg=cfg, hydra_cfg=cfg, working_dir=str(Path.cwd()),
                            task_name=str(cfg.hydra.job.name),
                            status=JobStatus.FAILED if failed else JobStatus.COMPLETED)
            ret.return_value = RuntimeError(f"task {task['job_id']} ended {task['state']}") if failed else task
            returns.append(ret)
        return returns
