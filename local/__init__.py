"""``pdserve up``: the local counterpart of the operator.

Starts the router and the worker pools as local processes, supervises them as a
kubelet would, and runs the planner loop when ``--autoscale`` is on. Nothing in
``router/`` imports from here.
"""
