"""The way back (tests/integration/test_wayback.py): megatrain_ds saves, real DeepSpeed ZeRO-3
resumes, on any number of ranks.

    # 2 ranks
    torchrun --nproc_per_node 2 wayback_run.py --engine megatrain --config ds.json --save CKPT
        --out run
    torchrun --nproc_per_node 2 wayback_run.py --engine deepspeed --config ds.json --resume CKPT
        --out ds

(the test starts one process per rank with torchrun's environment instead; one rank of megatrain_ds:
``main(argv)`` in the test's own process).

- megatrain_ds (``--save``): a model of seed 0 trains 3 steps, saves CKPT, trains 3 more (the
  uninterrupted run: ``straight``, 6 losses), then a fresh engine around a model of seed 1 loads
  CKPT and trains the same 3 steps (``resume``).
- DeepSpeed (``--resume``): a model of seed 1 is initialized first (start-up overlaps the saving
  run), waits for CKPT's ``latest``, loads it with DeepSpeed's default arguments and trains the same
  3 steps (``resume``); it also records its ZeRO-3 layout (``layout``: each sub-group's parameter
  names and fp32 partition size).

Step s of rank r trains on the batch seeded by (s, r), whichever engine and run. Each rank writes
``<out>.rank<r>.json``. The model: a tiny Llama with MLP biases of 75 elements (odd: ZeRO-3 pads
their 2-rank partitions) and frozen input norms (DeepSpeed restores them from
``frozen_param_fragments``).
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

STEPS = 3


def model(seed: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    m = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=75,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            mlp_bias=True,
            tie_word_embeddings=False,
        )
    )
    for layer in m.model.layers:
        layer.input_layernorm.requires_grad_(False)
    return m


def train(engine, first: int, steps: int, rank: int, record: dict) -> None:
    for step in range(first, first + steps):
        ids = torch.randint(
            0, 256, (2, 16), generator=torch.Generator().manual_seed(1000 + 10 * step + rank)
        )
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        record["loss"].append(loss.item())
        record["lr"].append(engine.get_lr()[0])


def start(deepspeed, config: dict, seed: int):
    m = model(seed)
    engine, *_ = deepspeed.initialize(
        model=m, model_parameters=[p for p in m.parameters() if p.requires_grad], config=config
    )
    return engine


def wait_for(path: str, timeout: float = 600.0) -> None:
    """The saving run writes ``latest`` last (after every rank's files are in place)."""
    deadline = time.time() + timeout
    while not os.path.isfile(path):
        if time.time() > deadline:
            raise TimeoutError(
                f"{path} did not appear in {timeout:.0f} s (did the saving run fail?)"
            )
        time.sleep(0.2)


def deepspeed_layout(engine) -> list:
    """DeepSpeed ZeRO-3's own sub-groups, as it built them: [(parameter names, fp32 partition
    elements)]."""
    opt = engine.optimizer
    return [
        ([engine.param_names[p] for p in group], flat.numel())
        for group, flat in zip(opt.fp16_groups, opt.fp32_partitioned_groups_flat)
    ]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--engine", choices=["megatrain", "deepspeed"], required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument(
        "--save", default=None, help="megatrain_ds: train, save here, train on; then resume it"
    )
    parser.add_argument(
        "--resume", default=None, help="DeepSpeed: wait for this checkpoint, resume it"
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.engine == "deepspeed":
        import deepspeed
    else:
        import megatrain_ds as deepspeed
    with open(args.config) as f:
        config = json.load(f)
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    config["train_batch_size"] = config["train_micro_batch_size_per_gpu"] * world
    out = {"rank": rank, "world": world}
    if args.save:
        engine = start(deepspeed, config, seed=0)
        out["straight"] = {"loss": [], "lr": []}
        train(engine, 0, STEPS, rank, out["straight"])
        engine.save_checkpoint(args.save)
        train(engine, STEPS, STEPS, rank, out["straight"])
        engine.destroy()
    # another init: everything must come from the checkpoint
    engine = start(deepspeed, config, seed=1)
    if args.resume:
        wait_for(os.path.join(args.resume, "latest"))
    path, _ = engine.load_checkpoint(args.save or args.resume)
    out["resumed_at"] = [path, engine.global_steps]
    out["resume"] = {"loss": [], "lr": []}
    train(engine, STEPS, STEPS, rank, out["resume"])
    if args.engine == "deepspeed":
        out["layout"] = deepspeed_layout(engine)
    else:
        engine.destroy()
    with open(f"{args.out}.rank{rank}.json", "w") as f:
        json.dump(out, f)
    # real DeepSpeed leaves its groups to the script (megatrain_ds destroys its own)
    if args.engine == "deepspeed":
        dist.destroy_process_group()
    return out


if __name__ == "__main__":
    main()
