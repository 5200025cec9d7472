"""Every message that crosses a process boundary, and nothing else: room addresses
(``addresses``), the room API's bodies (``rooms``), transports' offers and the transport registry
(``offers``), intake's frames and replies and its client (``intake``), what travels in vLLM's
``ec_transfer_params`` (``ec_params``) and the states every report names (``states``), the JSON
number types they share (``json_fields``) and the modalities (``modality``). Torch-free; every
process imports it downward."""
