"""The streaming core: the pipelined, double-buffered executor over three streams (``executor``,
``layer_call``: a layer call as one autograd node, ``streams``), the per-layer schedule, the
gradient landing, the step timer, pinned activations and the no-grad forwards of generation
(``inference``). Uses ``host`` (the state it streams), ``parallel`` and ``model``.
"""

from .activations import HostActivations
from .executor import StreamedLayers, weight_cache_layers
from .layer_call import positional_names
from .landing import LandingListener
from .schedule import LayerSchedule
from .streams import make_streams
from .timing import StepTimer, traced

# the names the other packages (and the top-level modules) use: test_structure.py's face rule
__all__ = [
    "HostActivations",
    "StreamedLayers",
    "weight_cache_layers",
    "positional_names",
    "LandingListener",
    "LayerSchedule",
    "make_streams",
    "StepTimer",
    "traced",
]
