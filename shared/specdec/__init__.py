"""Speculative decoding: sampling math, the device-side session, the decode loop."""
