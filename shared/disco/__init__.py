"""DiSCo (paper 003): cost-aware dispatch between device and server, and token-level migration.

Pure policy: cost.py (the unified cost and a request's ledger), dispatch.py (Algorithms 1-3),
migration.py (eqs. 4-5). No I/O; the token streamer drives them.
"""
