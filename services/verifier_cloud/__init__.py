"""verifier-cloud: the middle submodel behind a WebSocket, continuous batching across sessions."""
