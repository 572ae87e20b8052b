"""Jupiter (paper 002) parallelism planning: profile a model's per-layer time and memory, partition
its layers over an ordered list of heterogeneous edge devices (§IV-B1, eq. 1) and a prompt into
pipelined sub-sequences (§IV-B2, eqs. 2-4), and store the result as a reusable plan.

Planning is offline and pure (no torch outside `profile.measure_profile`): a plan is computed once
from a stored profile and reused by every request.
"""

from shared.jupiter.partition import Partition, PartitionError, brute_force_partition, equal_partition, partition_layers
from shared.jupiter.plan import DeviceSpec, EdgePlan, PlanError, build_plan, load_plan, parse_edge_pipeline, parse_lan
from shared.jupiter.profile import Profile, ProfileError, load_profile, measure_profile
from shared.jupiter.sequence import (
    SequencePlan,
    brute_force_sequence,
    equal_sub_sequences,
    min_subsequence_length,
    plan_sequences,
)

__all__ = [
    "DeviceSpec",
    "EdgePlan",
    "Partition",
    "PartitionError",
    "PlanError",
    "Profile",
    "ProfileError",
    "SequencePlan",
    "brute_force_partition",
    "brute_force_sequence",
    "build_plan",
    "equal_partition",
    "equal_sub_sequences",
    "load_plan",
    "load_profile",
    "measure_profile",
    "min_subsequence_length",
    "parse_edge_pipeline",
    "parse_lan",
    "partition_layers",
    "plan_sequences",
]
