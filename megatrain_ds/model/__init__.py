"""How a model splits into streamed decoder layers and small resident parts, and what one layer computes.

``model_map`` (the layout, the stateless layer templates), ``loss`` (LM head + cross-entropy without whole logits),
``tiling`` (sequence-tiled MLP), ``replay`` (what a recompute replays), ``recompute_check`` (the recompute checks
itself). Imports nothing of megatrain_ds's other packages: every package may use it.
"""
