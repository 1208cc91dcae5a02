"""The cluster simulator the planner is tuned and replayed on.

- ``host``: a machine's cores shared by the replicas (CFS, autogroups, queueing);
- ``cluster``: a fluid, vectorised model of a P/D cluster over time;
- ``goodput``: discrete engine steps per replica (colocated vs. disaggregated goodput);
- ``replay``: a recorded trace replayed through ``cluster`` on a profile's costs;
- ``scenarios``: the named load scenarios (arrivals, mixes, wrong profiles).

The scripts that run it (bench/simulate.py, bench/sim_vs_real*.py, bench/sim_mix*.py)
stay in bench/; this package imports nothing from bench/ or tests/.
"""
