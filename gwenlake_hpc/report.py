"""``python -m gwenlake_hpc report RUN_DIR``: a PNG of a run's metric curves with each restart marked."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import ConfigError
from .fsutil import read_json


def restart_steps(history: dict[str, list[tuple[int, int]]], start_times: list[float]) -> list[int]:
    """The first step logged after each restart.

    Args:
        history: metric -> [(step, timestamp in ms)].
        start_times: Unix seconds of every start of the run (``run.json``'s ``starts``), first one included.
    """
    points = sorted((ts, step) for series in history.values() for step, ts in series)
    marks = []
    for t in start_times[1:]:
        after = [step for ts, step in points if ts >= t * 1000]
        if after:
            marks.append(min(after))
    return marks


def report(run_dir: str | Path, out: str | Path | None = None, uri: str | None = None) -> tuple[Path, list[int]]:
    """Write ``<run_dir>/report.png`` (or ``out``): one panel per metric, the ``time/*`` metrics stacked in
    one panel (seconds per step: input, compute, checkpoint, tracking), dashed lines at restarts.

    Returns:
        (the PNG path, the restart steps marked).

    Raises:
        ConfigError: the run directory has no tracking state (tracking was off) or no metric.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from mlflow import MlflowClient

    run_dir = Path(run_dir)
    state = read_json(run_dir / "tracking" / "tracking.json")
    run_id_file = run_dir / "tracking" / "run_id"
    if state is None or not run_id_file.exists():
        raise ConfigError(f"{run_dir} has no MLflow run (tracking was off, or it never reached the server)")
    client = MlflowClient(uri or state["uri"])
    run = client.get_run(run_id_file.read_text().strip())
    points = {k: client.get_metric_history(run.info.run_id, k) for k in sorted(run.data.metrics)}
    history = {k: [(m.step, m.timestamp) for m in ms] for k, ms in points.items()}
    values = {k: {m.step: m.value for m in ms} for k, ms in points.items()}
    if not history:
        raise ConfigError(f"MLflow run {run.info.run_id} has no metrics yet")
    starts = [s["time"] for s in (read_json(run_dir / "run.json", default={}) or {}).get("starts", [])]
    marks = restart_steps(history, starts)
    # The Run's time/* metrics share one panel: where each step's time went (input, compute, checkpoints,
    # tracking), stacked, so the bottleneck shows at a glance.
    times = [k for k in history if k.startswith("time/")]
    panels: list[list[str]] = [[k] for k in history if k not in times] + ([times] if times else [])
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.6 * len(panels)), squeeze=False)
    for ax, keys in zip(axes[:, 0], panels):
        if keys is not panels[-1] or not times:
            key = keys[0]
            steps = sorted(values[key])
            ax.plot(steps, [values[key][s] for s in steps], marker="." if len(steps) < 50 else None, lw=1)
            ax.set_ylabel(key)
        else:
            steps = sorted(set().union(*(values[k] for k in keys)))
            ax.stackplot(steps, *[[values[k].get(s, 0.0) for s in steps] for k in keys],
                         labels=[k.split("/", 1)[1] for k in keys])
            ax.set_ylabel("seconds per step")
            ax.legend(loc="upper left", fontsize="small")
        for m in marks:
            ax.axvline(m, color="tab:red", ls="--", lw=1)
    axes[-1, 0].set_xlabel("step")
    axes[0, 0].set_title(f"{run_dir.parent.name} / {run_dir.name}: {len(marks)} restart(s)")
    fig.tight_layout()
    out = Path(out) if out else run_dir / "report.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    (out.with_suffix(".json")).write_text(json.dumps({"restarts_at_step": marks}) + "\n")
    return out, marks
