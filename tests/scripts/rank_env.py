"""Run a training script as this rank, after writing what reached the rank from its launcher.

    deepspeed --hostfile hosts rank_env.py dp_plain.py --out DIR ...     # then DIR/env{RANK}.json

``DIR/env{RANK}.json`` (DIR: the script's ``--out``): ``MEGATRAIN_DS``, ``SSH_CONNECTION`` (the
address the rank's
ssh session came in on: which "host" started it; absent when no ssh was involved) and the launcher's
rank variables.
The script then runs as ``__main__`` with the remaining arguments (tests/system/test_pdsh_launch.py,
test_accelerate_machines.py).
"""

import json
import os
import runpy
import sys
from pathlib import Path

local_rank = [
    a for a in sys.argv[1:] if a.startswith("--local_rank")
]  # the deepspeed launcher's, for the script
script, *args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
out = Path(args[args.index("--out") + 1])
out.mkdir(parents=True, exist_ok=True)
keys = (
    "MEGATRAIN_DS",
    "SSH_CONNECTION",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "CROSS_RANK",
)
(out / f"env{os.environ.get('RANK', '0')}.json").write_text(
    json.dumps({k: os.environ.get(k) for k in keys})
)
sys.argv = [script, *local_rank, *args]
runpy.run_path(script, run_name="__main__")
