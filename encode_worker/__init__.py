"""The encode worker: a real vision tower over batches of items, per-item row split, embedding
cache, and the send path that writes each item's rows into the receiver registered in its room."""
