"""The peer wire protocol: message types, framing, handshake and the KV stream."""
