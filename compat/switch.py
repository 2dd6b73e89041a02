"""The switch: with ``MEGATRAIN_DS=1`` in the environment, DeepSpeed's entry points run
megatrain_ds.

    # script, config, yaml unchanged
    MEGATRAIN_DS=1 accelerate launch --config_file ds_zero3.yaml train.py
    # Trainer(args=TrainingArguments(deepspeed=...))
    MEGATRAIN_DS=1 python train_with_trainer.py

Installing the package puts one line in site-packages (``megatrain_ds_switch.pth``, written by
setup.py) that Python runs at every interpreter start, in every process a launcher spawns::

    import os; os.environ.get('MEGATRAIN_DS') == '1' and __import__('compat.switch')

With the variable unset that is one dictionary lookup: nothing is imported, DeepSpeed is untouched.
With it set this module registers post-import hooks (compat/import_hook.py); still nothing is
imported until the script (or accelerate, or transformers) imports ``deepspeed`` itself. Real
DeepSpeed is then imported as usual (its comm, utils, version, lr_schedules stay real: accelerate
and transformers use them) and its entry points are redirected to megatrain_ds
(compat/deepspeed_redirect.py says which and why); accelerate, once imported, counts the processes
of a DeepSpeed run on a CPU-only machine as it does on GPUs (compat/accelerate_world.py), and
DeepSpeed's multi-node runner, once imported, exports ``MEGATRAIN_DS`` to every host
(compat/launcher_env.py).

In-process use, before anything imports deepspeed::

    import compat.switch; compat.switch.activate()
"""

from __future__ import annotations

import os

from .env import ENV


def requested() -> bool:
    """True when the environment asks for megatrain_ds (``MEGATRAIN_DS=1``)."""
    return os.environ.get(ENV) == "1"


def activate() -> None:
    """Redirect DeepSpeed's entry points to megatrain_ds in this process (idempotent)."""
    from . import accelerate_world, deepspeed_redirect, launcher_env
    from .import_hook import after_import

    for name, hook in {
        **deepspeed_redirect.HOOKS,
        **accelerate_world.HOOKS,
        **launcher_env.HOOKS,
    }.items():
        after_import(name, hook)


if requested():
    activate()
