"""The streaming core: the pipelined, double-buffered executor over three streams (``executor``,
``streams``), the per-layer schedule, the gradient landing, the step timer, pinned activations and the no-grad
forwards of generation (``inference``). Uses ``host`` (the state it streams), ``parallel`` and ``model``.
"""
