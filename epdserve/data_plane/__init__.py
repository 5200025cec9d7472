"""The data plane: registered memory pools and the transports (Mooncake, SHM, loopback) that move
an embedding's bytes from an encode worker's send ring into a prefill receiver's slot."""
