"""Cluster mode (`instgenie serve --cluster ADDRESS`): workers on the GPUs of many hosts, started
as Ray actors. Only this package imports Ray; single-host serving never loads it.

- actor.py: `WorkerActor`, one per worker, runs the existing worker process tree on its node.
- handle.py: `RemoteWorkerHandle`, the API process's handle of one actor (what server/pool.py
  uses in place of a local subprocess handle).
- fleet.py: the Ray connection, the nodes and how many workers each should run.
- membership.py: nodes joining and leaving while serving (slots added and removed).
The data plane stays msgpack over ZMQ, directly between the API process and each worker's
supervisor, CurveZMQ-encrypted and authenticated (instgenie/curve.py); Ray only starts, watches
and stops the workers.
"""
