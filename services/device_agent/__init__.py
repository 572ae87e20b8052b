"""device-agent: one per device; input/output submodels + draft adapter, HAT decoding against verifier-cloud."""
