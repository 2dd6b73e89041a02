"""The switch's environment variable, in a module of its own: switch.py reads it to decide, and
the hooks switch.py registers (deepspeed_redirect.py, launcher_env.py) name it in their messages
and export it to other hosts, without importing the switch that imports them."""

from __future__ import annotations

ENV = "MEGATRAIN_DS"
