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


def restart_steps(history: dict[str, list[tuple[int, int]]], starts: Sequence[Mapping[str, Any]]) -> list[int]:
    """The first step of each restart: each start's ``first_step`` in ``run.json`` (written by the start as its
    loop began: the step after the checkpoint it resumed from, so no clock is compared), every start that began
    a loop but the first one. A start that ended before its loop (``first_step`` null: a bad input, a failure
    in the function's set-up, a kill at start-up) is no restart and has no mark. A start recorded by an older
    version of gwenlake_hpc, without ``first_step``, is placed at the first step logged after its wall-clock
    ``time``.

    Args:
        history: metric -> [(step, timestamp in ms)].
        starts: every start of the run (``run.json``'s ``starts``), in order.

    """
    points = sorted((ts, step) for series in history.values() for step, ts in series)
    began = []
    for i, s in enumerate(starts):
        if "first_step" in s:
            if s["first_step"] is not None:
                began.append(int(s["first_step"]))
        elif i == 0:
            began.append(1)
        elif "time" in s:
            after = [step for ts, step in points if ts >= float(s["time"]) * 1000]
            if after:
                began.append(min(after))
    return began[1:]


def _starts(run_dir: Path) -> list[Mapping[str, Any]]:
    """``run.json``'s ``starts`` ([] without the file).

    Raises:
        ConfigError: the file is not a JSON object with a list of starts, each with a numeric ``time`` and
            ``first_step`` where it has them (damaged or edited by hand).
    """
    path = run_dir / "run.json"
    try:
        info = read_json(path, default={})
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} cannot be read ({exc}): it is the run's record; restore it") from None
    starts = info.get("starts", []) if isinstance(info, dict) else None
    def valid(s: Any) -> bool:
        return (isinstance(s, dict) and isinstance(s.get("time", 0), (int, float))
                and (s.get("first_step") is None or isinstance(s["first_step"], int)))

    if not isinstance(starts, list) or not all(valid(s) for s in starts):
        raise ConfigError(f"{path} is not a run record (a JSON object whose 'starts' is a list of objects, with "
                          "numbers for their 'time' and 'first_step'): restore it")
    return starts


#: Where every legend goes: beside its panel, right of the axes, top-aligned. Above the panel it covered the
#: panel's title (the run's name, the goodput summary); inside it hides the curve ("best" would scan every
#: point). ``tight_layout`` leaves the room for it.
_BESIDE = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "fontsize": "small", "frameon": False,
           "borderaxespad": 0.0}


def draw(values: Mapping[str, Mapping[int, float]], marks: Sequence[int], title: str,
         smoothing: float = SMOOTHING, starts: Sequence[Mapping[str, Any]] = ()) -> Any:
    """The report's figure: one panel per metric, the ``time/*`` metrics stacked in one panel (seconds per step:
    input, compute, checkpoint, tracking), dashed red lines at ``marks``; under them, with a ledger, one bar per
    start with the parts of its time (:func:`gwenlake_hpc.runtime.ledger.parts`, seconds) and its end. Each
    legend stands right of its panel (:data:`_BESIDE`), never over a title.

    Args:
        values: metric -> {step: value}.
        marks: steps where the run restarted.
        title: the first panel's title.
        smoothing: weight of :func:`smooth` in [0, 1); above 0, each metric's raw curve is drawn faint under its
            smoothed one, and the legend gives the weight. The ``time/*`` panel is drawn raw.
        starts: the goodput ledger's records (:func:`gwenlake_hpc.runtime.ledger.read_ledger`), or none.

    Returns:
        The matplotlib Figure (Agg backend); the caller saves and closes it.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # The Run's time/* metrics share one panel: where each step's time went (input, compute, checkpoints,
    # tracking), stacked, so the bottleneck shows at a glance.
    # time/*_rank compare the ranks (the slowest rank's seconds, the median, the slowest's index): not parts of a
    # step's time, so each has a panel of its own
    times = [k for k in values if k.startswith("time/") and not k.endswith("_rank")]
    # goodput/* are one point per start's end: the bars below show them
    panels: list[list[str]] = ([[k] for k in values if k not in times and not k.startswith("goodput/")]
                               + ([times] if times else []))
    rows = len(panels) + (1 if starts else 0)
    fig, axes = plt.subplots(rows, 1, figsize=(10, 2.6 * rows), squeeze=False)
    if starts:
        _bars(axes[-1, 0], starts)
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
                ax.legend(**_BESIDE)
            else:
                ax.plot(steps, ys, marker=marker, lw=1)
            ax.set_ylabel(key)
        else:
            steps = sorted(set().union(*(values[k] for k in keys)))
            ax.stackplot(steps, *[[values[k].get(s, 0.0) for s in steps] for k in keys],
                         labels=[k.split("/", 1)[1] for k in keys])
            ax.set_ylabel("seconds per step")
            ax.legend(**_BESIDE)
        for m in marks:
            ax.axvline(m, color="tab:red", ls="--", lw=1)
    axes[len(panels) - 1, 0].set_xlabel("step")
    axes[0, 0].set_title(title, loc="left", fontsize="medium")
    fig.tight_layout()
    return fig


def _bars(ax: Any, starts: Sequence[Mapping[str, Any]]) -> None:
    """One horizontal bar per start: its parts stacked (seconds), labelled with its end and first step."""
    from ..runtime import ledger as ledgers

    colours = {"startup_s": "tab:gray", "kept_s": "tab:green", "lost_s": "tab:red", "checkpoint_s": "tab:blue",
               "after_loop_s": "tab:purple", "suspended_s": "tab:cyan", "other_s": "tab:olive"}
    parts = [ledgers.parts(r) for r in starts]
    left = [0.0] * len(starts)
    ys = list(range(len(starts)))
    for key in ledgers.PARTS:
        widths = [p[key] for p in parts]
        ax.barh(ys, widths, left=left, color=colours[key], label=key[:-2].replace("_", " "))
        left = [a + b for a, b in zip(left, widths)]
    ax.set_yticks(ys, [f"start {r.get('start')}: {r.get('end')} (from step {r.get('first_step')})" for r in starts],
                  fontsize="small")
    ax.invert_yaxis()
    total = ledgers.summarize(list(starts))
    ax.set_title(ledgers.describe(total) or "goodput", loc="left", fontsize="small")
    ax.set_xlabel("seconds of each start")
    ax.legend(**_BESIDE)


def figure(run_dir: str | Path, uri: str | None = None,
           smoothing: float = SMOOTHING) -> tuple[Any, list[int], list[dict[str, Any]]]:
    """The report's figure of the run in ``run_dir`` (:func:`draw`), from its MLflow run's metrics, its
    ``run.json`` (the restarts) and its goodput ledger.

    Args:
        uri: the tracking URI (default: the one in ``tracking/tracking.json``).
        smoothing: EMA weight in [0, 1).

    Returns:
        (the matplotlib Figure, which the caller closes; the restart steps marked; the ledger's records).

    Raises:
        ConfigError: as :func:`report`.
    """
    smoothing = check_smoothing(smoothing)
    from mlflow import MlflowClient

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir} is not a run directory: give one under runs/<model>/ (the job prints it)")
    starts = _starts(run_dir)
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
    marks = restart_steps(history, starts)
    from ..runtime import ledger as ledgers

    from ..job.run_lock import RunLock

    # a start without an end is running only while its process may be (else it was killed)
    completed = bool((read_json(run_dir / "run.json", default={}) or {}).get("completed"))
    recs = ledgers.read_ledger(run_dir, live=not completed and RunLock.may_be_held(run_dir), completed=completed)
    fig = draw(values, marks, f"{run_dir.parent.name} / {run_dir.name}: {len(marks)} restart(s)", smoothing, recs)
    return fig, marks, recs


def report(run_dir: str | Path, out: str | Path | None = None, uri: str | None = None,
           smoothing: float = SMOOTHING) -> tuple[Path, list[int]]:
    """Write ``<run_dir>/report.png`` (or ``out``), drawn by :func:`draw` (:func:`figure`), and ``report.json``
    beside it (``restarts_at_step``, ``smoothing``, the ledger's ``goodput`` summary and each start's ``starts``
    parts).

    Args:
        smoothing: EMA weight in [0, 1) (TensorBoard's 0.6 by default; 0: raw curves only).

    Returns:
        (the PNG path, the restart steps marked).

    Raises:
        ConfigError: a smoothing weight outside [0, 1); ``run_dir`` is no directory; its ``run.json`` is
            damaged; the run directory has no tracking state (tracking was off) or no metric.
    """
    smoothing = check_smoothing(smoothing)
    import matplotlib.pyplot as plt

    from ..runtime import ledger as ledgers

    run_dir = Path(run_dir)
    fig, marks, recs = figure(run_dir, uri, smoothing)
    out = Path(out) if out else run_dir / "report.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    summary = ledgers.summarize(recs) if recs else None
    (out.with_suffix(".json")).write_text(json.dumps(
        {"restarts_at_step": marks, "smoothing": smoothing, "goodput": summary,
         "starts": [{"start": r.get("start"), "end": r.get("end"), "first_step": r.get("first_step"),
                     **ledgers.parts(r)} for r in recs]}, default=str) + "\n")
    return out, marks
