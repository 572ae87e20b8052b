"""What crosses a socket: the device <-> cloud message schema (schema.py), the msgpack layer under every message
(msgpack_codec.py), and the pipeline stages' transport: their message codec, framed links and first-bytes handshake."""
