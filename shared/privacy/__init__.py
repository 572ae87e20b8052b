"""Defences of the hidden states a device sends to the cloud: the secret rotation of the hidden basis
(hidden_rotation.py) and the device-side uplink wrappers that apply it or add noise (uplink_hardening.py)."""
