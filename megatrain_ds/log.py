"""The ``megatrain_ds`` logger: the engine's operational messages (the progress line, skipped steps,
the NVMe tier, the auto placement, ...), one owner for where they go and which ranks say them.

- ``logger = logging.getLogger("megatrain_ds")``. Where nothing configured it before this module is
  imported, it gets one handler that writes to the *current* ``sys.stdout`` (looked up per message,
  so ``contextlib. redirect_stdout`` and pytest's ``capsys`` see it, as they saw the ``print`` calls
  it replaced) and flushes after every message (progress lines appear as they happen), level INFO,
  and ``propagate = False`` (as DeepSpeed's own logger: a root handler from ``logging.basicConfig``
  does not print every line a second time).
- Format: ``[megatrain_ds] message`` at INFO (the text the engine always printed), ``[megatrain_ds]
  [WARNING] message`` at other levels.
- The user's configuration wins: a handler found on the logger at import is left alone (nothing is
  added, ``propagate`` untouched). Configured afterwards, ``logging.config.dictConfig`` naming
  ``megatrain_ds`` replaces our handler with the user's (and ``disable_existing_loggers`` silences
  the logger, as any library's); a handler added with ``addHandler`` prints beside ours, so remove
  ours (``logger.removeHandler(logger.handlers[0])``) to print only the user's way. To send the
  lines through the root logger's handlers instead, set ``propagate = True`` and remove ours; to
  quiet the engine, set the logger's level to WARNING. The level is set to INFO only where it was
  NOTSET.
- Ranks (``rank_filter``, on the logger, so it applies to every handler): a record below WARNING is
  logged on rank 0 only, unless it names its ranks: ``log(message, ranks=ALL_RANKS)`` (every rank)
  or ``ranks=(0, 3)``. WARNING and above are logged on every rank. The rank is
  ``torch.distributed``'s once a process group exists, else 0 -- the rank the engine's data-parallel
  group (dp.py) has.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable

NAME = "megatrain_ds"
PREFIX = f"[{NAME}]"
ALL_RANKS = -1

logger = logging.getLogger(NAME)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class RankFilter(logging.Filter):
    """Below WARNING: rank 0 only, or the ranks a record names in its ``ranks`` attribute
    (``ALL_RANKS``: every rank). WARNING and above: every rank, unless the record names its
    ranks."""

    def filter(self, record: logging.LogRecord) -> bool:
        ranks = getattr(record, "ranks", None)
        if ranks is None:
            return record.levelno >= logging.WARNING or _rank() == 0
        return ALL_RANKS in ranks or _rank() in ranks


class Formatter(logging.Formatter):
    """``[megatrain_ds] message`` at INFO, ``[megatrain_ds] [LEVEL] message`` otherwise."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return (
            f"{PREFIX} {text}"
            if record.levelno == logging.INFO
            else f"{PREFIX} [{record.levelname}] {text}"
        )


class StdoutHandler(logging.StreamHandler):
    """``sys.stdout`` as it is when a message is emitted (as ``logging``'s own last-resort handler
    does for stderr), flushed after each message."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(Formatter())

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    # StreamHandler.__init__ assigns it; the current sys.stdout is always used
    def stream(self, value) -> None:
        pass


rank_filter = RankFilter()
if not any(isinstance(f, RankFilter) for f in logger.filters):  # a reload keeps one
    logger.addFilter(rank_filter)
if logger.level == logging.NOTSET:  # the engine's lines are INFO; a level the user chose stays
    logger.setLevel(logging.INFO)
# the user configured no handler for this logger: print as the engine always has
if not logger.handlers:
    logger.addHandler(StdoutHandler())
    logger.propagate = False


def log(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """``message`` at ``level`` on ``ranks`` (``None``: rank 0 below WARNING, every rank from
    WARNING up; ``ALL_RANKS``: every rank), as DeepSpeed's ``log_dist``."""
    if ranks is None:
        logger.log(level, message, stacklevel=2)
    else:
        ranks = (ranks,) if isinstance(ranks, int) else tuple(ranks)
        logger.log(level, message, extra={"ranks": ranks}, stacklevel=2)
