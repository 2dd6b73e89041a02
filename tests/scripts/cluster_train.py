"""A training script as cluster users launch it: the same file under torchrun, SLURM and torchrun's
restarts
(tests/system/test_slurm.py, test_elastic.py).

    torchrun --standalone --nproc_per_node 2 cluster_train.py --out DIR
    srun -N1 -n2 python cluster_train.py --out DIR                          # each SLURM task a rank
    srun -N1 -n1 torchrun --standalone --nproc_per_node 2 cluster_train.py --out DIR
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node 2 --max-restarts 1 \
        cluster_train.py --out DIR --save DIR/ckpt --kill-rank 1 --kill-at 3

What a script must do to resume after a restart (the ``--save`` path): save a checkpoint every few
steps on every
rank (``engine.save_checkpoint(dir)``: it writes ``dir/latest`` last), and on start load ``dir``
when it holds a
``latest`` (``engine.load_checkpoint(dir)``: the weights, Adam moments, lr schedule and step
counters), then train
on from ``engine.global_steps``, drawing each step's batch from the step's number (not from how many
batches this
process has drawn), so that the resumed run trains on the batches the interrupted one would have.

A tiny Llama (fp32, AdamW, WarmupLR); rank r's batch at step s is drawn from seed 1000 * s + r. Each
rank appends
one line per optimizer step to ``DIR/rank<r>.jsonl`` (the step, its loss, the restart count torchrun
gives it,
its pid) and, when it raises, one ``{"error": ...}`` line. Faults, each at most once per run (a
marker file
``DIR/<fault>.done`` says it happened):
- ``--kill-rank R --kill-at K``: rank R SIGKILLs itself in step K, after backward() (a crash, an OOM
kill);
- ``--hang-rank R --hang-at K``: rank R sleeps for ever between backward() and step() of step K (a
stalled data
  loader, a debugger); the other ranks' engines time out (``--timeout``,
  megatrain.collective_timeout).
``--rank0-saves DIR``: after training, only rank 0 calls ``save_checkpoint(DIR)`` (a published
script's mistake:
every rank must) while the other ranks' scripts end; rank 0's engine then names them as exited.
"""

import argparse
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # tests.models, megatrain_ds
SCRIPT = os.path.abspath(__file__)
LAUNCH_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "MEGATRAIN_DS",
)


# ------------------------------------------------------------------------------------------ for the
# tests
def launch_env(base: dict | None = None, **extra) -> dict:
    """The environment a launch gets: CPU only, one OpenMP thread, the repository importable, no
    launcher variables
    of the test's own process."""
    env = {
        k: v for k, v in (base if base is not None else os.environ).items() if k not in LAUNCH_ENV
    }
    env.update(
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p),
        **extra,
    )
    return env


def torchrun(*script_args, launcher: tuple = (), nproc: int = 2) -> list[str]:
    """``torchrun --standalone --nproc_per_node 2 [launcher...] cluster_train.py
    [script_args...]``."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        *launcher,
        SCRIPT,
        *map(str, script_args),
    ]


def records(out: str, world: int = 2) -> dict[int, list[dict]]:
    """rank -> its lines (DIR/rank<r>.jsonl)."""
    result = {}
    for r in range(world):
        path = os.path.join(out, f"rank{r}.jsonl")
        result[r] = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    return result


def losses(out: str, world: int = 2) -> dict[int, dict[int, float]]:
    """rank -> {step: loss} (a step trained twice, before and after a restart: its last loss)."""
    return {
        r: {e["step"]: e["loss"] for e in lines if "loss" in e}
        for r, lines in records(out, world).items()
    }


@functools.lru_cache(maxsize=None)
def reference_losses(steps: int = 5) -> dict[int, dict[int, float]]:
    """The uninterrupted run under ``torchrun --nproc_per_node 2`` (once per test session)."""
    from tests.launch import run_again_after_exit_abort

    outs = []

    def launch():
        outs.append(tempfile.mkdtemp(prefix="cluster_train_ref_"))
        return subprocess.run(
            torchrun("--out", outs[-1], "--steps", str(steps)),
            env=launch_env(),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )

    proc = run_again_after_exit_abort(launch)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    result = losses(outs[-1])
    assert all(sorted(v) == list(range(steps)) for v in result.values()), result
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher passes it
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--save", default=None, help="checkpoint folder: save every step, resume from it"
    )
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="megatrain.collective_timeout, seconds"
    )
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--hang-rank", type=int, default=-1)
    parser.add_argument("--hang-at", type=int, default=-1)
    parser.add_argument("--rank0-saves", default=None)
    args = parser.parse_args()

    import torch

    import megatrain_ds as deepspeed
    from tests.models import tiny_hf

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": 1e-2}},
        "megatrain": {"collective_timeout": args.timeout},
    }
    engine, *_ = deepspeed.initialize(model=tiny_hf("llama", layers=3), config=config)
    rank = torch.distributed.get_rank()
    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, f"rank{rank}.jsonl"), "a")

    def record(**entry) -> None:
        entry.update(
            rank=rank,
            pid=os.getpid(),
            restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", -1)),
            world=torch.distributed.get_world_size(),
            env_rank=os.environ.get("RANK"),
            local_rank=os.environ.get("LOCAL_RANK"),
        )
        log.write(json.dumps(entry) + "\n")
        log.flush()

    def once(name: str, rank_arg: int, step_arg: int, step: int) -> bool:
        marker = os.path.join(args.out, f"{name}.done")
        if rank != rank_arg or step != step_arg or os.path.exists(marker):
            return False
        open(marker, "w").close()
        record(fault=name, step=step, time=time.time())
        return True

    try:
        if args.save and os.path.exists(os.path.join(args.save, "latest")):
            path, _ = engine.load_checkpoint(args.save)
            record(resumed=path, step=engine.global_steps)
        while engine.global_steps < args.steps:
            step = engine.global_steps
            gen = torch.Generator().manual_seed(1000 * step + rank)
            ids = torch.randint(0, 256, (2, 12), generator=gen)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            if once("kill", args.kill_rank, args.kill_at, step):
                os.kill(os.getpid(), signal.SIGKILL)
            if once("hang", args.hang_rank, args.hang_at, step):
                while True:
                    time.sleep(3600)
            engine.step()
            record(step=step, loss=loss.item())
            if args.save:
                engine.save_checkpoint(args.save)
        if args.rank0_saves and rank == 0:
            engine.save_checkpoint(args.rank0_saves)
        record(finished=True)
    except BaseException as exc:
        record(error={"type": type(exc).__name__, "message": str(exc), "time": time.time()})
        raise


if __name__ == "__main__":
    main()
