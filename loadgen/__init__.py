"""`tophat loadgen`: an open-loop load generator for the token streamer's OpenAI API.

Semantics follow `vllm bench serve` (gamma arrivals with a burstiness knob,
streamed completions, TTFT/TPOT/TBT/E2E percentiles, goodput) plus HAT's
metrics (accept length, prefill/decode SLA compliance, cloud compute delay).

Modules: `arrivals` (when), `workloads` (what), `runner` (send and record),
`metrics` (pure statistics), `plots` (PNG figures), `load_run` (one run, shared by the
benches), `cli` (the command); the benches (`bench*.py`, `bench_command` behind `tophat bench`)
and the simulator (`simulate/`). This package re-exports nothing: import the module you use.
"""
