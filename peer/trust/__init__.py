"""Who a peer is: machine keys, code pairing and pinned mutual TLS."""
