"""The fault driver's cases under real DeepSpeed (ZeRO-3, CPU offload, gloo), for
docs/reliability.md's comparison.

    # 2 ranks; rank 1 stalls 60 s between backward and step
    python tests/scripts/ds_faults.py rank stall default
    # the same with deepspeed.init_distributed(timeout=3 s)
    python tests/scripts/ds_faults.py rank stall 3
    # rank 1 os._exit()s there
    python tests/scripts/ds_faults.py rank exit default
    # a flipped byte; a full disk during a save (2 tags)
    python tests/scripts/ds_faults.py checkpoint

``rank`` launches 2 processes (plain env:// rendezvous), kills what is left after 90 s, and prints
what each rank raised and when; ``checkpoint`` runs in this process and prints a JSON report. Not
run by the tests.
"""

import builtins
import datetime
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-3}},
    "zero_optimization": {
        "stage": 3,
        "offload_param": {"device": "cpu"},
        "offload_optimizer": {"device": "cpu"},
    },
}


def rank_worker(mode: str, timeout: str, out: str) -> None:
    import deepspeed
    import torch

    from tests.models import tiny_hf

    rank = int(os.environ["RANK"])
    if timeout != "default":
        deepspeed.init_distributed(
            dist_backend="gloo", timeout=datetime.timedelta(seconds=float(timeout))
        )
    model = tiny_hf("llama")
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=CONFIG
    )
    record = {"events": {}}

    def write():
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(record, f)

    gen = torch.Generator().manual_seed(rank)
    try:
        for step in range(3):
            ids = torch.randint(0, 256, (2, 12), generator=gen)
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            if rank == 1 and step == 1:
                record["events"]["fault"] = time.time()
                write()
                if mode == "exit":
                    os._exit(17)
                time.sleep(60)
            record["events"][f"step{step}"] = time.time()
            write()
            engine.step()
        record["finished"] = time.time()
        write()
    except BaseException as exc:
        record["error"] = {
            "type": type(exc).__name__,
            "message": str(exc)[:500],
            "time": time.time(),
        }
        write()
        raise


def rank_main(mode: str, timeout: str) -> None:
    out = tempfile.mkdtemp(prefix="ds-faults-")
    port = str(20000 + random.randrange(20000))
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "rank-worker", mode, timeout, out],
            env=dict(
                os.environ,
                RANK=str(r),
                LOCAL_RANK=str(r),
                WORLD_SIZE="2",
                MASTER_PORT=port,
                MASTER_ADDR="127.0.0.1",
                CUDA_VISIBLE_DEVICES="",
                OMP_NUM_THREADS="1",
            ),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for r in (0, 1)
    ]
    deadline = time.time() + 90
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    end = time.time()
    for r in (0, 1):
        rec = json.load(open(os.path.join(out, f"rank{r}.json")))
        error = rec.get("error")
        since = rec["events"].get("step1") or rec["events"].get("fault")
        print(
            f"rank {r}: exit {procs[r].returncode}; "
            + (
                f"{error['type']} {error['time'] - since:.1f} s after it reached step 1: "
                f"{error['message'][:300]}"
                if error
                else f"no error; waited {end - since:.1f} s before the end"
                if since
                else "no record"
            )
        )
    shutil.rmtree(out, ignore_errors=True)


def checkpoint_main() -> None:
    os.environ.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(20000 + random.randrange(20000)),
    )
    import deepspeed
    import torch

    from tests.fault_driver import FullDisk
    from tests.models import tiny_hf, token_batches

    batches = token_batches(8, seed=11)

    def engine_(seed=0):
        m = tiny_hf("llama", tied=False, seed=seed)
        return deepspeed.initialize(model=m, model_parameters=m.parameters(), config=CONFIG)[0]

    def train(e, n):
        for _ in range(n):
            ids = batches[e.global_steps]
            e.backward(e(input_ids=ids, labels=ids).loss)
            e.step()

    def weights(e):
        ps = list(e.module.parameters())
        with deepspeed.zero.GatheredParameters(ps):
            return {n: p.detach().float().clone() for n, p in e.module.named_parameters()}

    def diff(a, b):
        return max(float((a[k] - b[k]).abs().max()) for k in a)

    root, report = tempfile.mkdtemp(prefix="ds-faults-"), {}
    # a flipped byte in the middle of the optimizer-states file, against a load of the intact copy
    e = engine_()
    train(e, 2)
    e.save_checkpoint(f"{root}/c")
    shutil.copytree(f"{root}/c", f"{root}/clean")
    folder = f"{root}/c/global_step2"
    name = next(n for n in os.listdir(folder) if "optim_states" in n)
    data = bytearray(open(f"{folder}/{name}", "rb").read())
    pos = len(data) // 2
    data[pos] ^= 0x10
    open(f"{folder}/{name}", "wb").write(bytes(data))
    t = engine_(seed=2)
    try:
        t.load_checkpoint(f"{root}/c")
        t2 = engine_(seed=2)
        t2.load_checkpoint(f"{root}/clean")
        d0 = diff(weights(t), weights(t2))
        train(t, 1), train(t2, 1)
        report["corrupt"] = (
            f"loaded without error ({name} byte {pos} of {len(data)}); max |weights - intact load| "
            "= "
            f"{d0:.3g}, after one more step {diff(weights(t), weights(t2)):.3g}"
        )
    except Exception as exc:  # noqa: BLE001
        report["corrupt"] = f"refused: {type(exc).__name__}: {str(exc)[:300]}"
    # a full disk during a save: DeepSpeed's torch.save(obj, path) opens the file in C++; here
    # through Python's open, so that the driver's byte budget applies (the same bytes are written)
    real_save = torch.save

    def save_via_open(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)):
            with builtins.open(f, "wb") as fh:
                return real_save(obj, fh, *args, **kwargs)
        return real_save(obj, f, *args, **kwargs)

    for same in (False, True):
        d = f"{root}/d{int(same)}"
        e = engine_()
        train(e, 1)
        e.save_checkpoint(d, tag="same" if same else None)
        previous = weights(e)
        train(e, 1)
        torch.save = save_via_open
        disk = FullDisk(200_000)
        try:
            with disk:
                e.save_checkpoint(d, tag="same" if same else None)
            error = "no error"
        except Exception as exc:  # noqa: BLE001
            error = f"{type(exc).__name__}: {str(exc)[:300]}"
        finally:
            torch.save = real_save
        latest = open(f"{d}/latest").read() if os.path.exists(f"{d}/latest") else None
        loaded = engine_(seed=3)
        try:
            loaded.load_checkpoint(d)
            then = (
                f"loads global step {loaded.global_steps}, max |weights - previous save| = "
                f"{diff(weights(loaded), previous):.3g}"
            )
        except Exception as exc:  # noqa: BLE001
            then = f"does not load: {type(exc).__name__}: {str(exc)[:200]}"
        report[f"disk_full_{'same_tag' if same else 'new_tag'}"] = {
            "save": error,
            "failed_writing": disk.failed_path and os.path.relpath(disk.failed_path, root),
            "latest": latest,
            "then": then,
        }
    shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    if sys.argv[1] == "rank":
        rank_main(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "rank-worker":
        rank_worker(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        checkpoint_main()
