"""One rank of a 2-rank gloo run in which one rank (the victim) stalls or dies; the tests read what
each rank saw.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python dp_fault.py --out DIR \
        --timeout 3 \
        --victim 1 --fault stall --at between --fault-step 1

A tiny Llama trains ``--steps`` steps (forward, backward, step; a checkpoint after ``--fault-step``
with ``--at save``). At step ``--fault-step`` the victim, at point ``--at``:
- ``--fault stall``: sleeps ``--stall`` seconds (then goes on, and fails in its next collective: its
  peer is gone);
- ``--fault exit``: ``os._exit(17)`` (a crash, a kill -9);
the points: ``before_forward`` (the script's own code before forward(): a data loader), ``between``
(after backward(), before step()), ``forward`` / ``backward`` / ``step`` / ``save`` (inside the
call: its first layer broadcast, its first gradient reduce, the norm all-reduce, the first
checkpoint file written). Each rank writes ``DIR/rank<r>.json``: the error it raised (type, message,
when), the fault's time on the victim, and whether it finished. ``launch_pair`` runs both ranks with
a bound. Used by tests/integration/test_collective_timeout.py and tests/fault_driver.py.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # the repository (tests.models, megatrain_ds)
# both processes must have exited by then (launch_pair kills what is left)
PROCESS_TIMEOUT_S = 120.0


def launch_pair(folder: str, args: list[str]):
    """This script on 2 ranks (plain processes, gloo, env:// rendezvous, output in
    ``folder``/rank<r>.log); waits at most ``PROCESS_TIMEOUT_S``, then kills what is left (its
    ``returncode`` is then None). Returns (procs, logs)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ,
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        PYTHONPATH=os.pathsep.join(x for x in (REPO, os.environ.get("PYTHONPATH", "")) if x),
    )
    procs, logs = {}, {}
    for r in (0, 1):
        logs[r] = os.path.join(folder, f"rank{r}.log")
        with open(logs[r], "w") as log:
            procs[r] = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--out", folder, *args],
                env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                start_new_session=True,
            )
    deadline = time.monotonic() + PROCESS_TIMEOUT_S
    for proc in procs.values():
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs.values():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            proc.returncode = None
    return procs, logs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout", type=float, default=3.0)
    parser.add_argument("--victim", type=int, default=1)
    parser.add_argument("--fault", choices=["stall", "exit", "none"], default="stall")
    parser.add_argument(
        "--at",
        choices=["before_forward", "forward", "backward", "between", "step", "save"],
        default="between",
    )
    parser.add_argument("--fault-step", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--stall", type=float, default=None, help="seconds (default: 3 x --timeout)"
    )
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    record = {"rank": rank, "events": {}, "error": None, "finished": False}
    path = os.path.join(args.out, f"rank{rank}.json")

    def write():
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)

    def event(name):
        record["events"][name] = time.time()
        write()

    def fault():
        event("fault")
        if args.fault == "exit":
            os._exit(17)
        time.sleep(args.stall if args.stall is not None else 3 * args.timeout)
        event("stall_over")

    import torch

    import megatrain_ds
    from megatrain_ds.checkpoints import checkpoint
    from megatrain_ds.parallel import dp
    from tests.models import tiny_hf

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "megatrain": {"collective_timeout": args.timeout, "check_recompute": False},
    }
    victim = rank == args.victim and args.fault != "none"
    armed = {"on": False}

    def fault_inside(owner, name):  # the victim faults at the first call of owner.name while armed
        real = getattr(owner, name)

        def hooked(*a, **k):
            if armed["on"]:
                armed["on"] = False
                fault()
            return real(*a, **k)

        setattr(owner, name, hooked)

    if victim and args.at in ("forward", "backward", "step", "save"):
        owner, name = {
            "forward": (dp.DataParallel, "broadcast_layer"),
            "backward": (dp.DataParallel, "reduce_layer_grad"),
            "step": (dp.DataParallel, "sum_norm"),
            "save": (checkpoint, "_save"),
        }[args.at]
        fault_inside(owner, name)
    try:
        engine, *_ = megatrain_ds.initialize(model=tiny_hf("llama"), config=config)
        event("initialized")
        gen = torch.Generator().manual_seed(rank)
        for step in range(args.steps):
            ids = torch.randint(0, 256, (2, 12), generator=gen)
            here = victim and step == args.fault_step
            armed["on"] = here and args.at in ("forward", "backward", "step")
            if here and args.at == "before_forward":
                fault()
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            if here and args.at == "between":
                fault()
            event(f"step{step}")
            engine.step()
            if args.at == "save" and step == args.fault_step:
                armed["on"] = victim
                engine.save_checkpoint(os.path.join(args.out, "ckpt"))
        record["finished"] = True
        write()
    except BaseException as exc:
        record["error"] = {
            "type": type(exc).__name__,
            "message": str(exc),
            "time": time.time(),
            "missing": getattr(exc, "missing", None),
        }
        write()
        raise


if __name__ == "__main__":
    main()
