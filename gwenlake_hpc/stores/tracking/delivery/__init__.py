"""Delivery: the job's points into its MLflow run, reliably, out of the training process.

- :mod:`.spool`: the on-disk queue between the training and the delivery (segments, writer, reader, staged
  artifact files); a point written there survives any kill of either process.
- :mod:`.state`: the run's tracking state folder (``tracking.json``, ``run_id``, ``pending_status``, the lock).
- :mod:`.delivery_process`: the delivery process as the training sees it (start, wake, restart, end; the line
  protocol's training end).
- :mod:`.deliverer`: the delivery process itself (``python -m gwenlake_hpc.stores.tracking.delivery``) and its
  :class:`~.deliverer.Deliverer`: connect, create or reattach, deliver the spool in order and exactly once.
- :mod:`.session`: one MLflow conversation for one run (the only MLflow client here: create or reattach,
  exactly-once points, params, tags, artifacts, inputs, the end status).
- :mod:`.sync`: ``tracking sync``, what a training could not deliver, delivered after it.

MLflow is imported only by :mod:`.session` and what runs it (the delivery process, ``tracking sync``); the
training imports :mod:`.delivery_process`, :mod:`.spool` and :mod:`.state` only. This side imports the store's
address (:mod:`..uri`, :mod:`..sqlite`) and the RL traces (:mod:`..rollouts`), never the user-MLflow side
(:mod:`..user_mlflow`) nor the Tracker.
"""
