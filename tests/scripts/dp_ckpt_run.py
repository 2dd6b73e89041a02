"""Checkpoints under data parallel (tests/integration/test_dp_checkpoint.py): train, save, resume,
with any number of ranks.

    # 2 ranks: train, save at step 2
    torchrun --nproc_per_node 2 dp_ckpt_run.py --out run.json --save CKPT
    # 1 process resumes it
    python dp_ckpt_run.py --out run.json --ga 2 --no-train --resume CKPT

(the test also calls ``main(argv)`` in its own process for the one-process runs: no start-up cost).

Every optimizer step consumes ``world * ga`` micro-batches drawn from one seeded generator (rank r's
k-th micro-batch of a step is global micro-batch ``k * world + r``), so a run of any world size with
the same ``world * ga`` trains the same global batches. The model is tests/models.py's PlainLM with
odd sizes (every parameter but two has an odd element count: ZeRO-3's partitions over 2 ranks are
padded) and its blocks' norms frozen (frozen parameters in the streamed layers, saved as ZeRO-3
frozen fragments).

Runs, each recorded under ``runs`` in ``--out`` (rank 0 writes; losses by global micro-batch index,
the learning rate per step, the final fp32 weights in ``<out>.<run>.pt``):
- ``straight``: a model of seed 0 trains ``--steps`` steps; ``--save`` saves a checkpoint after
  ``--save-at`` steps (the weights then go to ``<out>.at_save.pt``, gathered with
  ``export.gather_full_masters``); ``--export`` writes ``save_16bit_model`` at the end.
- ``resume<k>``: for the k-th ``--resume DIR``, a fresh engine around a model of seed 1 (everything
  must come from the checkpoint; the k-th ``--resume-mt`` its ``megatrain`` block) loads DIR and
  trains to ``--steps``; ``--end-save`` saves it at the end; the k-th ``--wait FILE`` makes it wait
  for FILE first.
- ``--refuse DIR``: a load whose check fails on one rank only; ``refused`` records what every rank
  raised.
``--engine deepspeed`` runs real DeepSpeed ZeRO-3 (CPU offload) for the straight run: a DeepSpeed
checkpoint.
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.models import PlainLM  # noqa: E402

VOCAB, WIDTH = 63, 33


def model(seed: int) -> torch.nn.Module:
    m = PlainLM(vocab=VOCAB, width=WIDTH, depth=3, seed=seed)
    for block in m.blocks:
        block.norm.requires_grad_(False)
    return m


def config(args, world: int, mt: str = "{}") -> dict:
    mt = json.loads(mt)
    return {
        **({"megatrain": mt} if mt else {}),
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": args.ga,
        "train_batch_size": 2 * args.ga * world,
        "steps_per_print": 1000,
        "gradient_clipping": 1.0,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.01},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": 1e-4,
                "warmup_max_lr": 3e-3,
                "warmup_num_steps": 2,
                "total_num_steps": 6,
            },
        },
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu"},
            "offload_optimizer": {"device": "cpu"},
        },
    }


def weights(engine, deepspeed, real: bool) -> dict:
    if real:
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    return {n: t.detach().clone() for n, t in engine.master_state_dict().items()}


def train(
    engine, deepspeed, args, rank: int, world: int, real: bool = False, save: bool = False
) -> dict:
    """From the engine's step to ``--steps``; the same batches whatever the world size."""
    gen = torch.Generator().manual_seed(1)
    record = {"loss": {}, "lr": [], "start": engine.global_steps}
    for step in range(args.steps):
        batches = [torch.randint(0, VOCAB, (2, 12), generator=gen) for _ in range(world * args.ga)]
        if step < record["start"]:
            continue
        for k in range(args.ga):
            ids = batches[k * world + rank]
            logits = engine(ids)
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1)
            )
            engine.backward(loss)
            engine.step()
            losses = [None] * world
            dist.all_gather_object(losses, (step * world * args.ga + k * world + rank, loss.item()))
            record["loss"].update({str(i): v for i, v in losses})
        record["lr"].append(engine.get_lr()[0])
        if save and step + 1 == args.save_at:
            engine.save_checkpoint(args.save, client_state={"rank": rank, "step": step + 1})
            if not real:
                from megatrain_ds.checkpoints.export import gather_full_masters

                at_save = {
                    n: t.clone() for n, t in gather_full_masters(engine.checkpoint_parts()).items()
                }
                if rank == 0:
                    torch.save(at_save, args.out + ".at_save.pt")
    record["weights"] = weights(engine, deepspeed, real)
    return record


def refuse(deepspeed, args, rank: int, world: int) -> list:
    """Load ``--refuse`` with the check failing on one rank only: [(exception type, message, engine
    untouched)] of every rank."""
    from megatrain_ds.checkpoints import checkpoint

    m = model(1)
    engine, *_ = deepspeed.initialize(
        model=m,
        model_parameters=[p for p in m.parameters() if p.requires_grad],
        config=config(args, world),
    )
    before = {n: t.clone() for n, t in engine.master_state_dict().items()}
    validate = checkpoint._validate

    def failing(*a, **kw):
        validate(*a, **kw)
        if rank == args.refuse_rank:
            raise checkpoint.CheckpointMismatchError("refused on this rank only (test)")

    checkpoint._validate, outcome = failing, None
    try:
        engine.load_checkpoint(args.refuse)
    except Exception as exc:  # noqa: BLE001
        outcome = (type(exc).__name__, str(exc))
    finally:
        checkpoint._validate = validate
    after = engine.master_state_dict()
    untouched = (
        all(torch.equal(after[n], t) for n, t in before.items()) and engine.global_steps == 0
    )
    engine.destroy()
    outcomes = [None] * world
    dist.all_gather_object(outcomes, (outcome, untouched))
    return outcomes


def main(argv=None) -> dict:
    """Runs as the docstring says; returns what it writes to ``--out`` (rank 0's record)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--engine", choices=["megatrain", "deepspeed"], default="megatrain")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--ga", type=int, default=1)
    parser.add_argument("--save", default=None)
    parser.add_argument("--save-at", type=int, default=2)
    parser.add_argument(
        "--export", default=None, help="save_16bit_model into this folder after the straight run"
    )
    parser.add_argument("--no-train", action="store_true", help="no straight run: only the resumes")
    parser.add_argument("--resume", action="append", default=[])
    parser.add_argument(
        "--resume-mt",
        action="append",
        default=[],
        help="megatrain_ds's config block (JSON) of the k-th resume (default: none)",
    )
    parser.add_argument(
        "--end-save",
        default=None,
        help="each resume saves a checkpoint at its end in DIR/resume<k>",
    )
    parser.add_argument(
        "--refuse",
        default=None,
        help="a resume of DIR whose load fails on --refuse-rank only: "
        "every rank must raise, with its engine untouched",
    )
    parser.add_argument("--refuse-rank", type=int, default=1)
    parser.add_argument(
        "--wait",
        action="append",
        default=[],
        help="the k-th resume first waits (up to 10 min) for this file (the record of the run that "
        "saves its checkpoint: that run started beside this one)",
    )
    args = parser.parse_args(argv)
    real = args.engine == "deepspeed"
    if real:
        import deepspeed
    else:
        import megatrain_ds as deepspeed

    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"world": world, "runs": {}}
    runs = {}
    if not args.no_train:
        m = model(0)
        engine, *_ = deepspeed.initialize(
            model=m,
            model_parameters=[p for p in m.parameters() if p.requires_grad],
            config=config(args, world),
        )
        runs["straight"] = train(
            engine, deepspeed, args, rank, world, real=real, save=bool(args.save)
        )
        if args.export:
            state = engine._zero3_consolidated_16bit_state_dict()
            nones = [None] * world
            dist.all_gather_object(nones, state is None)
            out["consolidated_is_none"] = nones
            engine.save_16bit_model(args.export, "model.bin")
            out["export_exists_on_return"] = os.path.isfile(os.path.join(args.export, "model.bin"))
        if not real:
            engine.destroy()
    for k, path in enumerate(args.resume):
        if k < len(args.wait) and args.wait[k]:
            deadline = time.time() + 600
            while not os.path.isfile(args.wait[k]) and time.time() < deadline:
                time.sleep(0.2)
        m = model(1)
        mt = args.resume_mt[k] if k < len(args.resume_mt) else "{}"
        engine, *_ = deepspeed.initialize(
            model=m,
            model_parameters=[p for p in m.parameters() if p.requires_grad],
            config=config(args, world, mt),
        )
        loaded, client = engine.load_checkpoint(path)
        runs[f"resume{k}"] = train(engine, deepspeed, args, rank, world)
        runs[f"resume{k}"].update(client=client, loaded=loaded, mt=mt)
        if args.end_save:
            engine.save_checkpoint(os.path.join(args.end_save, f"resume{k}"))
        engine.destroy()
    if args.refuse:
        out["refused"] = refuse(deepspeed, args, rank, world)
    for name, record in runs.items():
        if rank == 0:
            torch.save(record.pop("weights"), f"{args.out}.{name}.pt")
        out["runs"][name] = record
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(out, f)
    # real DeepSpeed leaves its groups to the script (megatrain_ds destroys its own at exit)
    if real:
        torch.distributed.destroy_process_group()
    return out


if __name__ == "__main__":
    main()
