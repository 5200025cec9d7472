"""`epd-prefill`: a reference prefill process around the receiver library (HTTP, FastAPI), above
it: ``app`` (the HTTP API), ``settings`` (``PrefillSettings``), ``cli`` (start-up).

``POST /v1/prefill`` takes a request's items (placeholder offsets + ``encode_handshake``, and
optionally the image bytes for fallback or verification), receives every item's rows, and
reports per item: rows x width, transport, latency (with the encode worker's own split from its
commit), outcome, and whether the rows equal a local tower's (``verify``, needs ``--model``).
An item with image bytes and no ``encode_handshake`` is encoded here by the local tower, as a
colocated engine would (transport ``local``); its rows must match its placeholders, as on the wire.
A request that reaches its ``timeout_s`` is answered 200 with its report: the items not yet settled
are FAILED ("timed out ..."), their rooms cancelled, their slots freed or quarantined as their rooms
end. ``/healthz`` is 503 once the process cannot receive at all (no transport left: restart it),
``/readyz`` also while no receive slot is free; both report the transports offered and lost.
It is what the demo, the integration tests and the Kubernetes example run, and it shows engine
developers the few calls an engine makes: ``receiver.start(request_id, mm_inputs)``, then
``job.poll()`` from the engine loop.
"""
