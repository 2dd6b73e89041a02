"""Data parallelism: ``dp`` (who owns which layer, the process groups, the gradient exchange),
``collective_watch`` (what a failed collective's error says: which ranks did not arrive, where they
were) and ``comm`` (``deepspeed.comm`` as scripts use it). Below the streaming core, which reduces
each layer's gradient through it.
"""

from . import comm
from .comm import ensure_deepspeed_comm, init_distributed
from .dp import DataParallel, Topology, done, resident_positions

# the names the other packages (and the top-level modules) use: test_structure.py's face rule
__all__ = [
    "comm",
    "ensure_deepspeed_comm",
    "init_distributed",
    "DataParallel",
    "Topology",
    "done",
    "resident_positions",
]
