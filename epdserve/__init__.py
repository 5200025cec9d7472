"""The EPD encode-worker project's own package: every module but the three the product card keeps
at the top level (`encode_worker`, `prefill_side`, `handshake`). `docs/architecture.md` lists its
subpackages, from the bottom floor up."""
