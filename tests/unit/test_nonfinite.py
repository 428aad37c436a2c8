"""Non-finite values: a NaN loss stops the run, never bare NaN in JSON, no candidate for NaN metrics, NaN data reported."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from gwenlake_hpc.data import write_dataset
from gwenlake_hpc.base.errors import NonFiniteError
from gwenlake_hpc.job.finish import finite_json
from gwenlake_hpc.runtime.run import Run
from gwenlake_hpc.runtime.signals import StopRequest
from gwenlake_hpc.stores.tracking import NullTracker


def make_run(tmp_path, **kw):
    return Run(run_dir=tmp_path / "run", run_key="k", steps=20, epochs=None, eval_every=10, seed=0,
               tracker=NullTracker(), stop=StopRequest(), progress="off", **kw)


def test_nan_loss_stops_and_other_metrics_warn_once(tmp_path, caplog):
    run = make_run(tmp_path)
    with pytest.raises(NonFiniteError, match=r"metric 'train/loss' is nan at step 3.*job.on_nonfinite=warn"):
        for step, _ in run.steps():
            run.log({"auc": float("nan")})
            run.log({"train/loss": 1.0 if step < 3 else float("nan")})
    assert sum("'auc' is nan" in r.getMessage() for r in caplog.records) == 1


def test_warn_setting_goes_on(tmp_path, caplog):
    run = make_run(tmp_path, on_nonfinite="warn")
    caplog.set_level(logging.WARNING)
    for step, _ in run.steps():
        run.log({"loss": float("inf") if step > 5 else 1.0})
    assert run.step == 20
    assert sum("'loss' is inf at step 6" in r.getMessage() for r in caplog.records) == 1


def test_finite_values_whose_sum_overflows_pass_and_opposite_infinities_are_each_reported(tmp_path, caplog):
    run = make_run(tmp_path, on_nonfinite="warn")
    caplog.set_level(logging.WARNING)
    run.log({"a": 1e308, "b": 1e308, "loss": 1.0}, step=1)  # finite, though their sum is not: no warning
    assert not [r for r in caplog.records if "is inf" in r.getMessage() or "is nan" in r.getMessage()]
    run.log({"up": float("inf"), "down": float("-inf"), "loss": 1.0}, step=2)  # their sum is NaN: both named
    messages = [r.getMessage() for r in caplog.records]
    assert sum("'up' is inf" in m for m in messages) == 1 and sum("'down' is -inf" in m for m in messages) == 1
    assert run.summary()["a"] == 1e308


def test_finite_json():
    doc = finite_json({"a": float("nan"), "b": [1.0, float("-inf")], "c": {"d": float("inf")}, "e": 2})
    assert json.loads(json.dumps(doc, allow_nan=False)) == {"a": "nan", "b": [1.0, "-inf"], "c": {"d": "inf"}, "e": 2}


def test_nan_in_a_dataset_is_reported_when_written(tmp_path, caplog):
    y = np.ones(10, dtype=np.float32)
    y[[2, 7]] = np.nan
    write_dataset(tmp_path, "g.d", {"x": np.zeros((10, 3), dtype=np.float32), "y": y})
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("column 'y' holds 2 NaN or infinite value(s) in 10 row(s)" in m for m in msgs), msgs
    assert not any("'x'" in m for m in msgs)


def test_nan_in_an_imported_table_is_reported_once_per_column(tmp_path, caplog):
    """`data import` writes in chunks: the NaN count of a column covers every chunk, reported once."""
    from gwenlake_hpc.data import Catalog

    csv = tmp_path / "t.csv"
    csv.write_text("a,b\n" + "".join(f"{i},{'' if i % 4 == 0 else i}\n" for i in range(10)))
    Catalog(tmp_path / "data").import_table(csv, "g.t", chunk_rows=3)
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "NaN" in r.getMessage()]
    assert len(msgs) == 1 and "column 'b' holds 3 NaN or infinite value(s) in 10 row(s)" in msgs[0], msgs
