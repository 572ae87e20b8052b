"""Measured privacy: what a curious cloud can recover from the hidden states it sees (issue 17)."""
