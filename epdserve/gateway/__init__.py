"""`epd-gateway`: the OpenAI-compatible front door. Chat requests come in; each image is placed on
an encode worker (``dispatcher``) and vLLM, with the EPD connector, gets the image's grid and room
instead of its pixels (``app``, ``chat``); image URLs are loaded under limits (``media``)."""
