"""The bootstrap-room handshake: one room per item pairs an encode worker's write with the prefill
receiver that reserved memory for it (state machine, REST app, client)."""
