"""The multimodal item model both sides share: ``items`` (items, pad ids), ``hashing`` (content
hashes), ``rows`` (the row contract) and ``wire`` (endpoints and room addresses). Import the module
you need: ``wire`` is torch-free, so the handshake server and clients load without torch."""
