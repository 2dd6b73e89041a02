"""A DeepSpeed-style training script for data-parallel launches
(tests/integration/test_dp_launchers.py).

    # import megatrain_ds as deepspeed
    torchrun --nproc_per_node 2 dp_plain.py --out DIR
    # the deepspeed launcher (adds --local_rank)
    deepspeed --num_gpus 2 dp_plain.py --out DIR
    # import deepspeed (real DeepSpeed ZeRO-3)
    torchrun --nproc_per_node 2 dp_plain.py --out DIR --real

``deepspeed.initialize(model=, config=, training_data=)`` builds the dataloader (DeepSpeed's: a
DistributedSampler over the data-parallel ranks); each sample carries its index, so every rank
reports which samples it trained on. Each rank prints one ``DP_REPORT {json}`` line and writes
``DIR/rank{R}.json`` (ranks, world sizes, ``train_batch_size``, the sample indices of each
micro-batch, losses, a digest of the final fp32 parameters) and ``DIR/rank{R}.pt`` (those
parameters, plus ``grad:NAME`` -- ``safe_get_full_grad`` before the last step -- and
``exp_avg:NAME`` -- ``safe_get_full_optimizer_state`` at the end -- for a parameter of a layer each
rank owns and a resident one). CPU only when ``DP_FORCE_CPU=1`` (the deepspeed launcher sets
CUDA_VISIBLE_DEVICES itself).
"""

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

if os.environ.get("DP_FORCE_CPU") == "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402
import transformers  # noqa: E402

SEQ, VOCAB, SAMPLES = 16, 256, 16
PROBES = (
    "model.layers.0.mlp.down_proj.weight",
    "model.layers.1.self_attn.k_proj.bias",
    "model.embed_tokens.weight",
)


class Indexed(torch.utils.data.Dataset):
    """Sample k: (k, a fixed random token sequence)."""

    def __init__(self) -> None:
        self.ids = torch.randint(
            0, VOCAB, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(1)
        )

    def __len__(self):
        return SAMPLES

    def __getitem__(self, k):
        return k, self.ids[k]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher passes it
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--real", action="store_true", help="real DeepSpeed instead of megatrain_ds"
    )
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps")
    parser.add_argument(
        "--zero-init",
        action="store_true",
        help="build the model inside deepspeed.zero.Init (before initialize: no process group yet)",
    )
    args = parser.parse_args()
    if args.real:
        import deepspeed
    else:
        import megatrain_ds as deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.01},
        },
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu"},
            "offload_optimizer": {"device": "cpu"},
        },
    }
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config, enabled=args.zero_init):
        model = transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=3,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=VOCAB,
                tie_word_embeddings=False,
            )
        )
    import torch.distributed as dist

    zero_init_world = dist.get_world_size() if dist.is_initialized() else None
    engine, _, loader, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config, training_data=Indexed()
    )
    report = {
        "zero_init_world": zero_init_world,
        "env_rank": int(os.environ.get("RANK", -1)),
        "local_rank_arg": args.local_rank,
        "dist_rank": dist.get_rank(),
        "dist_world": dist.get_world_size(),
        "backend": dist.get_backend(),
        "comm_world": deepspeed.comm.get_world_size(),
        "comm_rank": deepspeed.comm.get_rank(),
        "engine": f"{type(engine).__module__}.{type(engine).__name__}",
        "global_rank": engine.global_rank,
        "world_size": engine.world_size,
        "dp_world_size": engine.dp_world_size,
        "train_batch_size": engine.train_batch_size(),
        "micro": engine.train_micro_batch_size_per_gpu(),
        "ga": engine.gradient_accumulation_steps(),
        "loader_len": len(loader),
        "batches": [],
        "loss": [],
        "grad_norm": [],
    }
    named = dict(engine.module.named_parameters())
    # layer 0 (rank 0 owns it), layer 1 (rank 1), resident
    probes = [name for name in PROBES if name in named]
    extra = {}
    batches = iter(loader)
    micro_steps = args.steps * engine.gradient_accumulation_steps()
    for micro in range(micro_steps):
        index, ids = next(batches)
        ids = ids.to(engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        # the last window's gradients, between backward and step (every rank calls)
        if micro == micro_steps - 1:
            for name in probes:
                extra[f"grad:{name}"] = (
                    deepspeed.utils.safe_get_full_grad(named[name]).detach().float().cpu()
                )
        engine.step()
        report["batches"].append(index.tolist())
        report["loss"].append(loss.item())
        if boundary:
            report["grad_norm"].append(float(engine.get_global_grad_norm()))

    params = {
        name: deepspeed.utils.safe_get_full_fp32_param(p).detach().float().cpu()
        for name, p in engine.module.named_parameters()
    }
    for name in probes:
        extra[f"exp_avg:{name}"] = (
            deepspeed.utils.safe_get_full_optimizer_state(named[name], "exp_avg").float().cpu()
        )
    # megatrain_ds's setters write rank 0's value on every rank (GatheredParameters'
    # modifier_rank=0)
    if not args.real:
        report["set_readback"] = {}
        for name in probes:
            shape = extra[f"exp_avg:{name}"].shape
            deepspeed.utils.safe_set_full_optimizer_state(
                named[name], torch.full(shape, 0.5 / (1 + dist.get_rank())), "exp_avg"
            )
            readback = deepspeed.utils.safe_get_full_optimizer_state(named[name], "exp_avg")
            report["set_readback"][name] = sorted(set(readback.flatten().tolist()))
    digest = hashlib.sha256()
    for name, value in params.items():
        digest.update(name.encode() + value.contiguous().numpy().tobytes())
    report["digest"] = digest.hexdigest()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rank = report["dist_rank"]
    torch.save({**params, **extra}, out / f"rank{rank}.pt")
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    print("DP_REPORT " + json.dumps(report), flush=True)
    dist.barrier()
    sys.stdout.flush()
    # real DeepSpeed leaves its groups to the script (megatrain_ds destroys its own at exit)
    if args.real:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
