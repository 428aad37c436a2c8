"""report: the smoothed curves (TensorBoard's debiased exponential moving average) over the raw ones."""

from __future__ import annotations

import math

import pytest

from gwenlake_hpc.cli.dispatch import run_subcommand
from gwenlake_hpc.cli.report import draw, smooth


def test_smoothing_keeps_a_constant_series_constant_thanks_to_the_debias():
    # Without the debias the first points would be 3 * (1 - 0.5**n): 1.5, 2.25, 2.625.
    assert smooth([3.0, 3.0, 3.0, 3.0], 0.5) == [3.0, 3.0, 3.0, 3.0]


def test_smoothing_a_step_series_gives_the_debiased_averages():
    # last_n = 0.5 * last_{n-1} + 0.5 * x_n, divided by 1 - 0.5**n: 1, 1, 1.875/0.875, 2.4375/0.9375.
    assert smooth([1.0, 1.0, 3.0, 3.0], 0.5) == pytest.approx([1.0, 1.0, 15 / 7, 13 / 5], rel=1e-12)
    assert smooth([0.0, 10.0], 0.6) == pytest.approx([0.0, 4.0 / 0.64], rel=1e-12)


def test_weight_zero_returns_the_input_and_non_finite_points_pass_through():
    values = [0.3, -2.0, 7.5, 1e-9]
    assert smooth(values, 0.0) == values
    out = smooth([1.0, float("nan"), 3.0], 0.5)
    # The NaN is drawn as a gap and does not enter the average (as in TensorBoard).
    assert out[0] == 1.0 and math.isnan(out[1]) and out[2] == pytest.approx(1.75 / 0.75, rel=1e-12)


def test_the_panel_draws_the_raw_curve_faint_under_the_smoothed_one_with_the_weight_in_the_legend():
    loss = {s: (1.0 if s % 2 else 3.0) for s in range(1, 41)}
    fig = draw({"loss": loss}, marks=[21], title="t", smoothing=0.6)
    ax = fig.axes[0]
    raw, smoothed = ax.get_lines()[:2]
    assert list(raw.get_ydata()) == [loss[s] for s in range(1, 41)] and raw.get_alpha() < 0.5
    assert list(smoothed.get_ydata()) == smooth([loss[s] for s in range(1, 41)], 0.6)
    assert smoothed.get_color() == raw.get_color() and (smoothed.get_alpha() or 1.0) == 1.0
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["raw", "smoothed (EMA 0.6)"]
    assert [tuple(line.get_xdata()) for line in ax.get_lines()[2:]] == [(21, 21)]  # the restart

    plain = draw({"loss": loss}, marks=[], title="t", smoothing=0).axes[0]
    assert len(plain.get_lines()) == 1 and plain.get_legend() is None  # 0: the raw curve alone, not faint


@pytest.mark.parametrize("value", ["1", "-0.1", "nan", "abc"])
def test_a_bad_smoothing_weight_exits_2_naming_the_option(tmp_path, capsys, value):
    try:
        code = run_subcommand(["report", str(tmp_path), "--smoothing", value])
    except SystemExit as exc:  # argparse: not a number
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert "--smoothing" in err and "Traceback" not in err


def test_an_infinite_point_leaves_a_gap_and_the_curve_drawn():
    # MLflow stores inf as the largest double: read back, it is finite, and it used to flatten the whole panel.
    acc = {s: 0.5 + 0.01 * s for s in range(1, 11)}
    acc[4], acc[7] = 1.7976931348623157e308, float("inf")
    ax = draw({"acc": acc}, marks=[], title="t", smoothing=0.6).axes[0]
    raw = list(ax.get_lines()[0].get_ydata())
    assert [i + 1 for i, y in enumerate(raw) if math.isnan(y)] == [4, 7]
    assert [y for y in raw if not math.isnan(y)] == [acc[s] for s in range(1, 11) if s not in (4, 7)]
    low, high = ax.get_ylim()
    assert 0.4 < low < 0.52 and 0.59 < high < 0.7  # the axis fits the finite points
    assert "2 non-finite point(s) not drawn" in [t.get_text() for t in ax.texts]


def test_minus_zero_is_zero():
    from gwenlake_hpc.cli.report import check_smoothing

    assert str(check_smoothing("-0")) == "0.0"


def test_restart_marks_come_from_each_starts_first_step_not_its_clock():
    from gwenlake_hpc.cli.report import restart_steps

    # loss at steps 1..30, logged at 1000 ms per step from t=100 s; the second start's clock is an hour behind
    history = {"loss": [(s, 100_000 + 1000 * s) for s in range(1, 31)]}
    starts = [{"time": 100.0, "first_step": 1}, {"time": 111.0 - 3600, "first_step": 11},
              {"time": 121.0, "first_step": None}, {"time": 121.5, "first_step": 21}]
    assert restart_steps(history, starts) == [11, 21]
    # starts recorded before first_step existed: the first step logged after the start's time
    assert restart_steps(history, [{"time": 100.0}, {"time": 115.5}]) == [16]
    # the first start failed before its loop: the second one is the first training, no restart
    assert restart_steps(history, [{"time": 90.0, "first_step": None}, {"time": 99.0, "first_step": 1}]) == []


@pytest.mark.parametrize("text", ['{"starts": [{"time": 1', '[1, 2]', '{"starts": [{"first_step": "abc"}]}',
                                  '{"starts": 3}'])
def test_a_damaged_run_record_is_exit_2_naming_the_file(tmp_path, text, capsys):
    (tmp_path / "run.json").write_text(text)
    assert run_subcommand(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "run.json" in err and "Traceback" not in err


def test_a_file_instead_of_a_run_directory_is_exit_2(tmp_path, capsys):
    (tmp_path / "trainer.py").write_text("x = 1\n")
    assert run_subcommand(["report", str(tmp_path / "trainer.py")]) == 2
    assert "is not a run directory" in capsys.readouterr().err


def test_the_ranks_comparison_is_not_stacked_with_the_seconds_of_a_step():
    """The adversarial pass's input: a 2-rank run's time/slowest_rank (a rank index, 1.0) and the slowest and
    median ranks' seconds were stacked with input, compute, checkpoint and tracking as if parts of a step."""
    steps = range(10, 60, 10)
    values = {"loss": {s: 1.0 / s for s in steps},
              **{f"time/{k}": {s: 0.002 for s in steps} for k in ("input", "compute", "checkpoint", "tracking")},
              "time/step_max_rank": {s: 0.011 for s in steps}, "time/step_median_rank": {s: 0.009 for s in steps},
              "time/slowest_rank": {s: 1.0 for s in steps}}
    fig = draw(values, marks=[], title="t", smoothing=0.0)
    stacked = [ax for ax in fig.axes if ax.get_ylabel() == "seconds per step"]
    assert len(stacked) == 1
    assert [t.get_text() for t in stacked[0].get_legend().get_texts()] == ["input", "compute", "checkpoint",
                                                                           "tracking"]
    own = {ax.get_ylabel() for ax in fig.axes}
    assert {"time/step_max_rank", "time/step_median_rank", "time/slowest_rank"} <= own
