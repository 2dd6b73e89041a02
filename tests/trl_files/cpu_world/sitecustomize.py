"""Real DeepSpeed's side of tests/integration/test_trl.py with several ranks on a CPU-only machine
(on PYTHONPATH for those launches only; every process of the launch runs it at start).

accelerate counts the processes of a DeepSpeed run from a backend it picks itself, and on CPU it
picks none: each rank says ``num_processes == 1``, so real DeepSpeed stops at its batch assertion
(``train_batch_size`` 2 != 2 x 1 x 2) before TRL's script trains. ``MEGATRAIN_DS=1`` fixes that
count (compat/accelerate_world.py); this applies the same fix, and only it, to the real DeepSpeed
runs, so both engines see the world a GPU machine would show them. The TRL scripts stay unmodified.
"""

import os

if os.environ.get("MEGATRAIN_DS") != "1":
    from compat import accelerate_world
    from compat.import_hook import after_import

    for _name, _hook in accelerate_world.HOOKS.items():
        after_import(_name, _hook)
