"""An accelerate training script for data-parallel launches
(tests/integration/test_dp_launchers.py).

    MEGATRAIN_DS=1 accelerate launch --config_file examples/accelerate_ds.yaml --num_processes 2 \
        dp_accelerate.py --out DIR

The script knows nothing about megatrain_ds: ``Accelerator()`` (DeepSpeed ZeRO-3 offload from the
yaml, GA 2), a tiny Qwen2 built with ``from_config`` (under ``deepspeed.zero.Init``: the yaml's
``zero3_init_flag``), a torch AdamW, a plain DataLoader of indexed samples that
``accelerator.prepare`` shards over the ranks. Each rank writes ``DIR/rank{R}.json``: accelerate's
and torch.distributed's view of the world, ``train_batch_size`` (accelerate's DeepSpeed config and
the engine's), the sample indices of each micro-batch, losses (its own and
``accelerator.gather``-ed), a digest of the final fp32 parameters (and ``DIR/rank{R}.pt``, those
parameters). ``DP_COUNT_CPU_WORLD=1`` without the switch: real DeepSpeed, with only accelerate's
process count on CPU fixed as the switch fixes it (without that, real DeepSpeed stops on CPU:
compat/accelerate_world.py).
"""

import argparse
import hashlib
import json
import os
from pathlib import Path

if os.environ.get("DP_COUNT_CPU_WORLD") == "1" and os.environ.get("MEGATRAIN_DS") != "1":
    # real DeepSpeed on CPU: only accelerate's process count as the switch fixes it
    # (compat/accelerate_world.py)
    from compat import accelerate_world
    from compat.import_hook import after_import

    for _name, _hook in accelerate_world.HOOKS.items():
        after_import(_name, _hook)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
from accelerate import Accelerator  # noqa: E402

SEQ, VOCAB, SAMPLES = 16, 256, 16


class Indexed(torch.utils.data.Dataset):
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
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch_size", type=int, default=2)
    args = parser.parse_args()

    accelerator = Accelerator()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.Qwen2Config(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            tie_word_embeddings=False,
        ),
        dtype=torch.float32,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    loader = torch.utils.data.DataLoader(Indexed(), batch_size=args.batch_size, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    report = {
        "engine": f"{type(model).__module__}.{type(model).__name__}",
        "num_processes": accelerator.num_processes,
        "process_index": accelerator.process_index,
        "is_main_process": accelerator.is_main_process,
        "dist_rank": dist.get_rank(),
        "dist_world": dist.get_world_size(),
        "backend": dist.get_backend(),
        "config_train_batch_size": accelerator.deepspeed_config["train_batch_size"],
        "config_micro": accelerator.deepspeed_config["train_micro_batch_size_per_gpu"],
        "train_batch_size": model.train_batch_size(),
        "ga": model.gradient_accumulation_steps(),
        "dp_world_size": model.dp_world_size,
        "global_rank": model.global_rank,
        "loader_len": len(loader),
        "batches": [],
        "loss": [],
        "gathered_loss": [],
        "grad_norm": [],
    }
    model.train()
    for index, ids in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if accelerator.sync_gradients:
                report["grad_norm"].append(float(model.get_global_grad_norm()))
        report["batches"].append(index.tolist())
        report["loss"].append(loss.item())
        report["gathered_loss"].append(accelerator.gather(loss.detach().reshape(1)).tolist())

    accelerator.wait_for_everyone()
    from deepspeed.utils import safe_get_full_fp32_param

    params = {
        name: safe_get_full_fp32_param(p).detach().float().cpu()
        for name, p in accelerator.unwrap_model(model).named_parameters()
    }
    digest = hashlib.sha256()
    for name, value in params.items():
        digest.update(name.encode() + value.contiguous().numpy().tobytes())
    report["digest"] = digest.hexdigest()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(params, out / f"rank{report['dist_rank']}.pt")
    (out / f"rank{report['dist_rank']}.json").write_text(json.dumps(report))
    accelerator.print("DP_REPORT " + json.dumps(report))
    accelerator.end_training()


if __name__ == "__main__":
    main()
