"""The peer link's well-known ports (plain constants: the command line reads them without
importing the TLS and pairing stacks)."""

PREFILL_PORT = 7611  # where `duet peer serve` listens for decoders
PAIR_PORT = 7612  # where `duet peer pair` waits for the machine typing the code
