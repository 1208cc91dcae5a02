"""SLO-driven autoscaling of the prefill and decode pools.

``pdserve.planner.plan.plan`` is a pure function: a metrics snapshot, the planner
state and the config go in; a decision (desired replicas per pool, with the
reason in words) and the next state come out. ``metrics`` builds snapshots from
Prometheus text or the Prometheus HTTP API, ``local`` runs the loop for
``pdserve up --autoscale`` and ``profile`` measures per-replica capacities.
"""
