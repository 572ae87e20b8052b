"""DiSCo (paper 003): cost-aware dispatch between device and server, and token-level migration.

Pure policy: cost.py (the unified cost and a request's ledger), dispatch.py (Algorithms 1-3),
migration.py (eqs. 4-5). No I/O; the token streamer drives them.
"""

from shared.disco.cost import SERVER_ENDPOINTS, CostLedger, CostModel, Endpoint, parse_device_energy
from shared.disco.dispatch import (
    Decision,
    DispatchPolicy,
    Distribution,
    device_wait_plan,
    length_threshold_server,
    random_decision,
    tail_wait,
)
from shared.disco.migration import buffer_tokens, expected_remaining, migration_saving, migration_target

__all__ = [
    "SERVER_ENDPOINTS", "CostLedger", "CostModel", "Decision", "DispatchPolicy", "Distribution",
    "Endpoint", "buffer_tokens", "device_wait_plan", "expected_remaining", "length_threshold_server",
    "migration_saving", "migration_target", "parse_device_energy", "random_decision", "tail_wait",
]
