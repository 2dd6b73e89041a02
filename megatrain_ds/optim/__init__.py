"""The host optimizer: exact global-norm clipping and fused CPU AdamW per layer, overlapped with the
GPU, with the hand-offs of its threads (``optimizer``), the update kernels (``host_update``),
speculative stepping (``speculation``), the resident parameters (``resident``) and fp16 loss scaling
(``loss_scale``). Sits above the streaming core, whose gradient landings it listens to.
"""

from .host_update import lands_fp32, resolve_kernel
from .loss_scale import LossScaler, LossScaling, cast_inputs_half
from .optimizer import HostAdamW, HostAdamWParts
from .resident import ResidentParams
from .speculation import SpeculationPolicy

# the names the other packages (and the top-level modules) use: test_structure.py's face rule
__all__ = [
    "lands_fp32",
    "resolve_kernel",
    "LossScaler",
    "LossScaling",
    "cast_inputs_half",
    "HostAdamW",
    "HostAdamWParts",
    "ResidentParams",
    "SpeculationPolicy",
]
