"""``python -m gwenlake_hpc report RUN_DIR``: a PNG of a run's metric curves with each restart marked.

Each metric is drawn smoothed (TensorBoard's debiased exponential moving average, ``--smoothing``) over its raw
curve drawn faint, so a noisy loss shows its trend and its spread.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..base.errors import ConfigError
from ..base.fsutil import read_json

#: TensorBoard's default smoothing weight.
SMOOTHING = 0.6


def check_smoothing(weight: Any) -> float:
    """``weight`` as a float in [0, 1).

    Raises:
        ConfigError: not a number in [0, 1) (the message names ``--smoothing``).
    """
    try:
        w = float(weight)
    except (TypeError, ValueError):
        w = math.nan
    if not 0.0 <= w < 1.0:  # NaN fails this too
        raise ConfigError(f"--smoothing {weight}: give a weight in [0, 1): 0 draws the raw curves alone, "
                          f"{SMOOTHING} is TensorBoard's default, 0.9 or more suits a very noisy metric")
    return w + 0.0  # -0.0 becomes 0.0


#: MLflow stores an infinite metric as the largest double (``sys.float_info.max``): read back, it is finite.
_STORED_INF = 1.7976931348623157e308


def drawable(values: Sequence[float]) -> tuple[list[float], int]:
    """``values`` with each point that cannot be drawn (NaN, ±inf, and ±inf as MLflow stores it: the largest
    double) replaced by NaN, which matplotlib leaves as a gap; and how many were replaced. Without this, one such
    point stretches the axis until the whole curve is flat or gone."""
    out = [x if math.isfinite(x) and abs(x) < _STORED_INF else math.nan for x in values]
    return out, sum(1 for x in out if math.isnan(x))


def smooth(values: Sequence[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average debiased at the start.

    ``last = weight * last + (1 - weight) * x`` from ``last = 0``, each point divided by ``1 - weight**n``
    (``n`` finite points so far), so the first points are not pulled towards 0 and a constant series stays
    constant. Non-finite points are returned as they are and do not enter the average.

    Args:
        values: the series, in step order (length n).
        weight: in [0, 1); 0 returns the values unchanged.

    Returns:
        The smoothed series, length n.
    """
    out: list[float] = []
    last, n = 0.0, 0
    for x in values:
        if not math.isfinite(x):
            out.append(x)
            continue
        last = last * weight + (1.0 - weight) * x
        n += 1
        out.append(last / (1.0 - weight ** n))
    return out


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


def draw(values: Mapping[str, Mapping[int, float]], marks: Sequence[int], title: str,
         smoothing: float = SMOOTHING) -> Any:
    """The report's figure: one panel per metric, the ``time/*`` metrics stacked in one panel (seconds per step:
    input, compute, checkpoint, tracking), dashed red lines at ``marks``.

    Args:
        values: metric -> {step: value}.
        marks: steps where the run restarted.
        title: the first panel's title.
        smoothing: weight of :func:`smooth` in [0, 1); above 0, each metric's raw curve is drawn faint under its
            smoothed one, and the legend gives the weight. The ``time/*`` panel is drawn raw.

    Returns:
        The matplotlib Figure (Agg backend); the caller saves and closes it.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # The Run's time/* metrics share one panel: where each step's time went (input, compute, checkpoints,
    # tracking), stacked, so the bottleneck shows at a glance.
    times = [k for k in values if k.startswith("time/")]
    panels: list[list[str]] = [[k] for k in values if k not in times] + ([times] if times else [])
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.6 * len(panels)), squeeze=False)
    for ax, keys in zip(axes[:, 0], panels):
        if keys is not panels[-1] or not times:
            key = keys[0]
            steps = sorted(values[key])
            ys, gaps = drawable([values[key][s] for s in steps])
            marker = "." if len(steps) < 50 else None
            if gaps:
                ax.text(0.01, 0.98, f"{gaps} non-finite point(s) not drawn", transform=ax.transAxes, va="top",
                        fontsize="small", color="tab:red")
            if smoothing:
                (raw,) = ax.plot(steps, ys, marker=marker, lw=1, alpha=0.3, label="raw")
                ax.plot(steps, smooth(ys, smoothing), lw=1.6, color=raw.get_color(),
                        label=f"smoothed (EMA {smoothing:g})")
                # Above the panel, right: it never hides the curve ("best" would scan every point).
                ax.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=2, fontsize="small", frameon=False,
                          borderaxespad=0.1)
            else:
                ax.plot(steps, ys, marker=marker, lw=1)
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
    axes[0, 0].set_title(title, loc="left", fontsize="medium")
    fig.tight_layout()
    return fig


def report(run_dir: str | Path, out: str | Path | None = None, uri: str | None = None,
           smoothing: float = SMOOTHING) -> tuple[Path, list[int]]:
    """Write ``<run_dir>/report.png`` (or ``out``), drawn by :func:`draw`, and ``report.json`` beside it
    (``restarts_at_step``, ``smoothing``).

    Args:
        smoothing: EMA weight in [0, 1) (TensorBoard's 0.6 by default; 0: raw curves only).

    Returns:
        (the PNG path, the restart steps marked).

    Raises:
        ConfigError: a smoothing weight outside [0, 1); the run directory has no tracking state (tracking was
            off) or no metric.
    """
    smoothing = check_smoothing(smoothing)
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
    fig = draw(values, marks, f"{run_dir.parent.name} / {run_dir.name}: {len(marks)} restart(s)", smoothing)
    out = Path(out) if out else run_dir / "report.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    (out.with_suffix(".json")).write_text(json.dumps({"restarts_at_step": marks, "smoothing": smoothing}) + "\n")
    return out, marks
