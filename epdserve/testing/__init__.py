"""The process harness the tests, the benchmarks and the demo share: every role as a real
process on loopback (`cluster`; in the tests forked from a server with the imports done:
`forked_roles`), a receive job's items (`receive_items`), a transfer peer process (`peer`), vLLM
servers with the EPD connector (`vllm_servers`), and synthetic images (`images`)."""
