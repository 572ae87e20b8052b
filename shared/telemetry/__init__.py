"""What the mesh measures and reports: the state monitor's Redis keys and sink (sink.py), the services' fire-and-forget
client (client.py), Prometheus metrics (metrics.py), TTFT/TBT/accept-length definitions (latency_stats.py) and the
log-once bookkeeping of an absent telemetry peer (outage.py)."""
