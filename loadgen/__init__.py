"""`tophat loadgen`: an open-loop load generator for the token streamer's OpenAI API.

Semantics follow `vllm bench serve` (gamma arrivals with a burstiness knob,
streamed completions, TTFT/TPOT/TBT/E2E percentiles, goodput) plus HAT's
metrics (accept length, prefill/decode SLA compliance, cloud compute delay).

Modules: `arrivals` (when), `workloads` (what), `runner` (send and record),
`metrics` (pure statistics), `plots` (PNG figures), `cli` (the command).
"""
