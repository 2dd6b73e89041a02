"""A DeepSpeed-style training script for the data-parallel tests: the same global batches whatever
the world size.

    # 2 ranks, micro-batch M each
    torchrun --nproc_per_node 2 dp_train.py --out run.json --ga 1
    # 1 process, GA 2: the same global batch
    python dp_train.py --out run.json --ga 2

Every optimizer step consumes ``world * ga`` micro-batches drawn from one seeded generator; rank r's
k-th micro-batch of a step is global micro-batch ``k * world + r``. Losses are recorded by global
index (gathered to rank 0), with the step's learning rate and global grad norm; the final fp32
weights (full, every rank's layers) go to ``--out``'s ``.pt`` twin. ``--engine deepspeed`` runs real
DeepSpeed (ZeRO-3, CPU offload).
"""

import argparse
import atexit
import hashlib
import json
import os

import torch
import torch.distributed as dist
import transformers


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--engine", choices=["megatrain", "deepspeed"], default="megatrain")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--ga", type=int, default=1)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--tied", action="store_true")
    parser.add_argument("--save", default=None, help="save a checkpoint here after --save-at steps")
    parser.add_argument("--save-at", type=int, default=2)
    parser.add_argument("--load", default=None, help="resume from this checkpoint folder first")
    parser.add_argument("--mt", default="{}", help="megatrain_ds's own config block (JSON)")
    parser.add_argument(
        "--lora", type=int, default=0, help="peft LoRA of this rank on every linear layer"
    )
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument(
        "--bf16-masters", action="store_true", help="with --bf16: bf16_master_weights_and_grads"
    )
    parser.add_argument(
        "--bf16-moments", action="store_true", help="with --bf16-masters: bf16_optimizer_states"
    )
    parser.add_argument(
        "--nvme", default=None, help="offload_optimizer.device nvme with this nvme_path"
    )
    parser.add_argument(
        "--nvme-masters", action="store_true", help="with --nvme: offload_param.device nvme too"
    )
    args = parser.parse_args()
    # registered before the engine's own exit handler, so it runs after it (atexit is LIFO):
    # megatrain_ds must have destroyed the process groups by then (a gloo group alive at interpreter
    # exit can abort; comm.py)
    atexit.register(
        lambda: open(f"{args.out}.exit{os.environ.get('RANK', '0')}", "w").write(
            "destroyed" if not dist.is_initialized() else "alive"
        )
    )
    if args.engine == "deepspeed":
        import deepspeed
    else:
        import megatrain_ds as deepspeed

    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        tie_word_embeddings=args.tied,
    )
    model = transformers.Qwen2ForCausalLM(config)
    if args.lora:
        import peft

        model = peft.get_peft_model(
            model,
            peft.LoraConfig(
                r=args.lora,
                lora_alpha=2 * args.lora,
                target_modules=[
                    "q_proj",
                    "k_proj",
                    "v_proj",
                    "o_proj",
                    "gate_proj",
                    "up_proj",
                    "down_proj",
                ],
            ),
        )
        with torch.no_grad():  # LoRA B starts at zero: give every adapter a gradient at step 0
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.02)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": args.ga,
        "train_batch_size": args.micro * args.ga * world,
        "steps_per_print": 1000,
        "gradient_clipping": args.clip,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 2e-3, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.01},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 2e-3, "warmup_num_steps": 2},
        },
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu"},
            "offload_optimizer": {"device": "cpu"},
        },
    }
    if args.bf16:
        ds_config["bf16"] = {
            "enabled": True,
            **({"bf16_master_weights_and_grads": True} if args.bf16_masters else {}),
            **({"bf16_optimizer_states": True} if args.bf16_moments else {}),
        }
    if args.nvme:  # the NVMe tier (each rank's own swap file for the layers it owns)
        ds_config["zero_optimization"]["offload_optimizer"] = {
            "device": "nvme",
            "nvme_path": args.nvme,
            "buffer_count": 2,
            "pipeline_read": True,
            "pipeline_write": True,
        }
        if args.nvme_masters:  # the NVMe layers' fp32 masters join their moments on disk
            ds_config["zero_optimization"]["offload_param"] = {
                "device": "nvme",
                "nvme_path": args.nvme,
            }
    if args.engine == "megatrain" and json.loads(args.mt):
        ds_config["megatrain"] = json.loads(args.mt)
    params = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=ds_config)
    rank, world = dist.get_rank(), dist.get_world_size()
    assert engine.train_batch_size() == args.micro * args.ga * world
    start = 0
    if args.load:
        engine.load_checkpoint(args.load)
        start = engine.global_steps
    gen = torch.Generator().manual_seed(1)
    record = {"loss": {}, "lr": [], "grad_norm": [], "world": world}
    for step in range(args.steps):
        batches = [
            torch.randint(0, 256, (args.micro, 16), generator=gen) for _ in range(world * args.ga)
        ]
        if step < start:
            continue
        for k in range(args.ga):
            index = k * world + rank
            ids = batches[index].to(engine.device)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses = [None] * world
            dist.all_gather_object(losses, (step * world * args.ga + k * world + rank, loss.item()))
            record["loss"].update({str(i): v for i, v in losses})
        record["lr"].append(engine.get_lr()[0])
        record["grad_norm"].append(float(engine.get_global_grad_norm()))
        if args.save and step + 1 == args.save_at:
            engine.save_checkpoint(args.save)
    if args.engine == "deepspeed":
        params = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params):
            weights = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    else:
        weights = {n: t.clone() for n, t in engine.master_state_dict().items()}
    digest = hashlib.sha256(
        b"".join(weights[n].float().numpy().tobytes() for n in sorted(weights))
    ).hexdigest()
    digests = [None] * world
    dist.all_gather_object(digests, digest)
    record["digests"] = digests
    # host elements per rank: each holds the layers it owns only (dp.py)
    if args.engine == "megatrain":
        held = [None] * world
        dist.all_gather_object(
            held, (engine.store.n_full, sum(l.numel for l in engine.store.layouts))
        )
        record["host_elements"] = held
        record["moments_dtype"] = str(engine.store.exp_avg.dtype)
        # the resident parameters whose state each rank holds, and its host bytes
        res = engine.resident
        mine = {
            "resident": sorted(
                n
                for n, p in engine.module.named_parameters()
                for k, q in enumerate(res.params)
                if p is q and res.trained[k] and res.holds(k)
            ),
            "host_bytes": engine.host_memory()["total_bytes"],
            "local_world": engine.dp.local_world,
            "grad_hold": engine.decisions.grad_hold,
        }
        ranks = [None] * world
        dist.all_gather_object(ranks, mine)
        record["ranks"] = ranks
        # the planner's host bytes for this host's ranks (one copy per host: dp.py)
        if rank == 0 and not args.lora:
            from megatrain_ds.planning import plan

            meta = plan.meta_model(config)
            cfg = plan.parse_config(dict(ds_config), world_size=world, warn=False)
            record["planned_host_bytes"] = plan.plan_model(
                meta, cfg, device="cpu", world=engine.dp.local_world
            ).host_state_bytes
    if rank == 0:
        torch.save(weights, args.out + ".pt")
        with open(args.out, "w") as f:
            json.dump(record, f)
    if args.engine == "deepspeed":  # real DeepSpeed leaves its groups to the script
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
