"""How a model splits into streamed decoder layers and small resident parts, and what one layer
computes.

``model_map`` (the layout, the stateless layer templates), ``loss`` (LM head + cross-entropy without
whole logits), ``tiling`` (sequence-tiled MLP), ``replay`` (what a recompute replays),
``recompute_check`` (the recompute checks itself). Imports nothing of megatrain_ds's other packages:
every package may use it.
"""

from .loss import default_chunk_rows, fused_loss_parts, linear_cross_entropy
from .model_map import (
    HOOK_DICTS,
    LayerLayout,
    UnsupportedModelError,
    build_layout,
    find_block_list,
    has_tied_tensors,
    make_template,
    per_layer_attributes,
    shared_parameter_ids,
    submodule_pairs,
)
from .recompute_check import (
    TOLERANCE,
    RecomputeCheck,
    RecomputeMismatch,
    nonfinite_gradients_message,
    steps_to_check,
)
from .recompute_check import validate_setting as validate_check
from .recompute_skip import install as install_recompute_skip
from .recompute_skip import recomputing
from .recompute_skip import validate_setting as validate_recompute_skip
from .replay import autocast_as, autocast_state, get_rng_state, replay_rng
from .tiling import TiledForward, apply_tiling, chunk_rows
from .tiling import validate_setting as validate_tiling

# the names the other packages (and the top-level modules) use: test_structure.py's face rule
__all__ = [
    "default_chunk_rows",
    "fused_loss_parts",
    "linear_cross_entropy",
    "HOOK_DICTS",
    "LayerLayout",
    "UnsupportedModelError",
    "build_layout",
    "find_block_list",
    "has_tied_tensors",
    "make_template",
    "per_layer_attributes",
    "shared_parameter_ids",
    "submodule_pairs",
    "TOLERANCE",
    "RecomputeCheck",
    "RecomputeMismatch",
    "nonfinite_gradients_message",
    "steps_to_check",
    "validate_check",
    "install_recompute_skip",
    "recomputing",
    "validate_recompute_skip",
    "autocast_as",
    "autocast_state",
    "get_rng_state",
    "replay_rng",
    "TiledForward",
    "apply_tiling",
    "chunk_rows",
    "validate_tiling",
]
