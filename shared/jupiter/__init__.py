"""Jupiter (paper 002) parallelism planning: profile a model's per-layer time and memory, partition
its layers over an ordered list of heterogeneous edge devices (§IV-B1, eq. 1) and a prompt into
pipelined sub-sequences (§IV-B2, eqs. 2-4), and store the result as a reusable plan.

Planning is offline and pure (no torch outside `profile.measure_profile`): a plan is computed once
from a stored profile and reused by every request.
"""
