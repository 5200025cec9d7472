"""The vision code both wings share: the tower families and their sizing rules (``families``,
``sizing``), the towers loaded alone and their attention (``tower``, ``attention``), what media the
towers take and how it is decoded (``limits``, ``images``, ``video``), and small checkpoints of the
real classes for tests and the demo (``small_checkpoints``, ``vlm_checkpoints``). The encode worker
encodes with it; a receiver imports it only for its local-tower fallback. ``limits`` is
torch-free."""
