#!/usr/bin/env python
"""Supervised fine-tuning written the way DeepSpeed-Chat's step 1 is written, for the test suite.

    deepspeed dschat_sft_train.py --model_name_or_path PATH --zero_stage 3 --offload --dtype bf16
        --output_dir OUT

It mirrors https://github.com/deepspeedai/DeepSpeedExamples (Apache-2.0, commit 45b4b7156c87):
applications/DeepSpeed-Chat/training/step1_supervised_finetuning/main.py and the dschat helpers it
calls (utils/ds_utils.py get_train_ds_config, utils/model/model_utils.py create_hf_model,
utils/utils.py get_optimizer_grouped_parameters / get_all_reduce_mean / _z3_params_to_fetch /
save_hf_format / save_zero_three_model, utils/perf.py print_throughput): the same DeepSpeed calls in
the same order, written anew in one file. What differs, so that it runs in CI with no network and no
tokenizer:

- the data: seeded synthetic token sequences in place of create_prompt_dataset's Hugging Face
  datasets;
- the model: any local Hugging Face causal-LM checkpoint (the test writes a tiny one); no tokenizer,
  so the pad/end token ids come from the model config;
- no LoRA options (DeepSpeed-Chat's LinearLayer_LoRA);
- at the end it also writes a DeepSpeed checkpoint, ``model.save_checkpoint(output_dir)``, as
  DeepSpeedExamples' training/DeepSpeed-ZenFlow/finetuning/finetune_llama.py and
  DeepSpeed-SuperOffload/finetune_zero3.py do, and reports ``deepspeed.comm.get_rank()`` as
  DeepSpeed-Chat's step 2 asks it.

tests/integration/test_surface_scripts.py runs it with the import line changed to ``import
megatrain_ds as deepspeed``.
"""

import argparse
import math
import os
import random
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    SchedulerType,
    default_data_collator,
    get_scheduler,
    set_seed,
)
from transformers.integrations.deepspeed import HfDeepSpeedConfig

import deepspeed
from deepspeed import get_accelerator
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus


def parse_args():
    parser = argparse.ArgumentParser(
        description="Finetune a transformers model on a causal language modeling task"
    )
    parser.add_argument("--model_name_or_path", type=str, required=True)
    parser.add_argument(
        "--num_train_samples", type=int, default=64, help="synthetic training sequences"
    )
    parser.add_argument("--per_device_train_batch_size", type=int, default=16)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=16)
    parser.add_argument("--max_seq_len", type=int, default=512)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument("--num_train_epochs", type=int, default=1)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument(
        "--lr_scheduler_type",
        type=SchedulerType,
        default="cosine",
        choices=[
            "linear",
            "cosine",
            "cosine_with_restarts",
            "polynomial",
            "constant",
            "constant_with_warmup",
        ],
    )
    parser.add_argument("--num_warmup_steps", type=int, default=0)
    parser.add_argument("--output_dir", type=str, default=None)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--local_rank", type=int, default=-1, help="local_rank for distributed training on gpus"
    )
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--dropout", type=float, default=None)
    parser.add_argument("--offload", action="store_true", help="Enable ZeRO Offload techniques.")
    parser.add_argument("--dtype", type=str, default="fp16", choices=["fp16", "bf16"])
    parser.add_argument("--zero_stage", type=int, default=0)
    parser.add_argument("--enable_tensorboard", action="store_true")
    parser.add_argument("--tensorboard_path", type=str, default="step1_tensorboard")
    parser.add_argument("--print_loss", action="store_true")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


# -------------------------------------------------------- dschat/utils (as DeepSpeed-Chat has them)
GLOBAL_BATCH_SIZE = 32
MICRO_BATCH_SIZE = 4


def get_train_ds_config(
    offload,
    dtype,
    stage=2,
    enable_hybrid_engine=False,
    inference_tp_size=1,
    release_inference_cache=False,
    pin_parameters=True,
    tp_gather_partition_size=8,
    max_out_tokens=512,
    enable_tensorboard=False,
    tb_path="",
    tb_name="",
):
    device = "cpu" if offload else "none"
    if dtype == "fp16":
        data_type = "fp16"
        dtype_config = {"enabled": True, "loss_scale_window": 100}
    elif dtype == "bf16":
        data_type = "bfloat16"
        dtype_config = {"enabled": True}
    zero_opt_dict = {
        "stage": stage,
        "overlap_comm": True,
        "offload_param": {"device": device},
        "offload_optimizer": {"device": device},
        "stage3_param_persistence_threshold": 1e4,
        "stage3_max_live_parameters": 3e7,
        "stage3_prefetch_bucket_size": 3e7,
        "memory_efficient_linear": False,
    }
    return {
        "train_batch_size": GLOBAL_BATCH_SIZE,
        "train_micro_batch_size_per_gpu": MICRO_BATCH_SIZE,
        "steps_per_print": 10,
        "zero_optimization": zero_opt_dict,
        data_type: dtype_config,
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "hybrid_engine": {
            "enabled": enable_hybrid_engine,
            "max_out_tokens": max_out_tokens,
            "inference_tp_size": inference_tp_size,
            "release_inference_cache": release_inference_cache,
            "pin_parameters": pin_parameters,
            "tp_gather_partition_size": tp_gather_partition_size,
        },
        "tensorboard": {
            "enabled": enable_tensorboard,
            "output_path": f"{tb_path}/ds_tensorboard_logs/",
            "job_name": f"{tb_name}_tensorboard",
        },
    }


def print_rank_0(msg, rank=None):
    if rank is not None and rank <= 0:
        print(msg)
    elif not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(msg)


def to_device(batch, device):
    return {k: v.to(device) if hasattr(v, "to") else v for k, v in batch.items()}


def set_random_seed(seed):
    if seed is not None:
        set_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        get_accelerator().manual_seed_all(seed)


def get_all_reduce_mean(tensor):
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
    return tensor / torch.distributed.get_world_size()


def get_optimizer_grouped_parameters(
    model,
    weight_decay,
    lora_lr=5e-4,
    no_decay_name_list=(
        "bias",
        "layer_norm.weight",
        "layernorm.weight",
        "norm.weight",
        "ln_f.weight",
    ),
    lora_name_list=("lora_right_weight", "lora_left_weight"),
):
    def decays(n):
        return not any(nd in n.lower() for nd in no_decay_name_list)

    def is_lora(n):
        return any(nd in n.lower() for nd in lora_name_list)

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {
            "params": [p for n, p in named if decays(n) and not is_lora(n)],
            "weight_decay": weight_decay,
        },
        {
            "params": [p for n, p in named if decays(n) and is_lora(n)],
            "weight_decay": weight_decay,
            "lr": lora_lr,
        },
        {"params": [p for n, p in named if not decays(n)], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def _z3_params_to_fetch(param_list):
    return [
        p
        for p in param_list
        if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE
    ]


def save_hf_format(model, args, sub_folder=""):
    model_to_save = model.module if hasattr(model, "module") else model
    output_dir = os.path.join(args.output_dir, sub_folder)
    os.makedirs(output_dir, exist_ok=True)
    save_dict = model_to_save.state_dict()
    for key in list(save_dict.keys()):
        if "lora" in key:
            del save_dict[key]
    torch.save(save_dict, os.path.join(output_dir, "pytorch_model.bin"))
    model_to_save.config.to_json_file(os.path.join(output_dir, "config.json"))


def save_zero_three_model(model_ema, global_rank, save_dir, zero_stage=0):
    zero_stage_3 = zero_stage == 3
    os.makedirs(save_dir, exist_ok=True)
    output_model_file = os.path.join(save_dir, "pytorch_model.bin")
    model_to_save = model_ema.module if hasattr(model_ema, "module") else model_ema
    if not zero_stage_3:
        if global_rank == 0:
            torch.save(model_to_save.state_dict(), output_model_file)
        return
    output_state_dict = {}
    for k, v in model_to_save.named_parameters():
        if hasattr(v, "ds_id"):
            with deepspeed.zero.GatheredParameters(_z3_params_to_fetch([v]), enabled=zero_stage_3):
                v_p = v.data.cpu()
        else:
            v_p = v.cpu()
        if global_rank == 0 and "lora" not in k:
            output_state_dict[k] = v_p
    if global_rank == 0:
        torch.save(output_state_dict, output_model_file)


def create_hf_model(model_class, model_name_or_path, ds_config=None, dropout=None):
    model_config = AutoConfig.from_pretrained(model_name_or_path)
    if dropout is not None:
        for key in ("dropout", "attention_dropout", "hidden_dropout", "activation_dropout"):
            if hasattr(model_config, key):
                setattr(model_config, key, dropout)
    # https://huggingface.co/docs/transformers/main_classes/deepspeed#nontrainer-deepspeed-integration
    if ds_config is not None and ds_config["zero_optimization"]["stage"] == 3:
        # kept alive: transformers builds under zero.Init
        dschf = HfDeepSpeedConfig(ds_config)  # noqa: F841
    else:
        dschf = None  # noqa: F841
    model = model_class.from_pretrained(model_name_or_path, config=model_config)
    model.config.end_token_id = model.config.eos_token_id
    model.config.pad_token_id = model.config.eos_token_id
    model.resize_token_embeddings(int(8 * math.ceil(model.config.vocab_size / 8.0)))
    return model


def print_throughput(hf_model, args, e2e_time, rank=0):
    if rank <= 0:
        hf_config = hf_model.config
        gpus_per_model = torch.distributed.get_world_size()
        batch_size = args.per_device_train_batch_size
        checkpoint_activations_factor = 4 if args.gradient_checkpointing else 3
        hf_model._num_params = sum(
            p.ds_numel if hasattr(p, "ds_tensor") else p.numel() for p in hf_model.parameters()
        )
        params_in_billions = hf_model._num_params / 1e9
        flops = (
            24
            * checkpoint_activations_factor
            * batch_size
            * args.max_seq_len
            * hf_config.num_hidden_layers
            * hf_config.hidden_size**2
        )
        train_tflops = flops / (e2e_time * gpus_per_model * 10**12)
        print(
            f"Model Parameters: {params_in_billions:.6f} B, Latency: {e2e_time:.2f}s, TFLOPs: "
            f"{train_tflops:.4f}, "
            f"Samples/sec: {batch_size / e2e_time:.2f}, Batch Size: {batch_size}, "
            f"Sequence Length: {args.max_seq_len}"
        )


class SyntheticPromptDataset(Dataset):
    """In place of create_prompt_dataset: sequences that continue an arithmetic progression
    (learnable)."""

    def __init__(self, n, seq_len, vocab_size, seed):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab_size, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        self.ids = (start + stride * torch.arange(seq_len)) % vocab_size

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        ids = self.ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


# -------------------------------------------------------------- step1_supervised_finetuning/main.py
def main():
    args = parse_args()

    if args.local_rank == -1:
        device = torch.device(get_accelerator().device_name())
    else:
        get_accelerator().set_device(args.local_rank)
        device = torch.device(get_accelerator().device_name(), args.local_rank)
        # Initializes the distributed backend which will take care of sychronizing nodes/GPUs
        deepspeed.init_distributed()

    args.global_rank = torch.distributed.get_rank()

    ds_config = get_train_ds_config(
        offload=args.offload,
        dtype=args.dtype,
        stage=args.zero_stage,
        enable_tensorboard=args.enable_tensorboard,
        tb_path=args.tensorboard_path,
        tb_name="step1_model",
    )
    ds_config["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
    ds_config["train_batch_size"] = (
        args.per_device_train_batch_size
        * torch.distributed.get_world_size()
        * args.gradient_accumulation_steps
    )

    set_random_seed(args.seed)
    torch.distributed.barrier()

    model = create_hf_model(
        AutoModelForCausalLM, args.model_name_or_path, ds_config, dropout=args.dropout
    )

    vocab = model.config.vocab_size
    train_dataset = SyntheticPromptDataset(
        args.num_train_samples, args.max_seq_len, vocab, args.seed
    )
    eval_dataset = SyntheticPromptDataset(
        max(args.num_train_samples // 4, 1), args.max_seq_len, vocab, args.seed + 1
    )
    if args.local_rank == -1:
        train_sampler = RandomSampler(train_dataset)
        eval_sampler = SequentialSampler(eval_dataset)
    else:
        train_sampler = DistributedSampler(train_dataset)
        eval_sampler = DistributedSampler(eval_dataset)
    train_dataloader = DataLoader(
        train_dataset,
        collate_fn=default_data_collator,
        sampler=train_sampler,
        batch_size=args.per_device_train_batch_size,
    )
    eval_dataloader = DataLoader(
        eval_dataset,
        collate_fn=default_data_collator,
        sampler=eval_sampler,
        batch_size=args.per_device_eval_batch_size,
    )

    def evaluation(model, eval_dataloader):
        model.eval()
        losses = 0
        for step, batch in enumerate(eval_dataloader):
            batch = to_device(batch, device)
            with torch.no_grad():
                outputs = model(**batch)
            losses += outputs.loss.float()
        losses = losses / (step + 1)
        try:
            losses = get_all_reduce_mean(losses)
        except Exception:
            pass
        try:
            perplexity = torch.exp(losses).item()
        except OverflowError:
            perplexity = float("inf")
        return perplexity, losses.item()

    optimizer_grouped_parameters = get_optimizer_grouped_parameters(model, args.weight_decay)
    AdamOptimizer = DeepSpeedCPUAdam if args.offload else FusedAdam
    optimizer = AdamOptimizer(
        optimizer_grouped_parameters, lr=args.learning_rate, betas=(0.9, 0.95)
    )

    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    lr_scheduler = get_scheduler(
        name=args.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps,
        num_training_steps=args.num_train_epochs * num_update_steps_per_epoch,
    )

    model, optimizer, _, lr_scheduler = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        args=args,
        config=ds_config,
        lr_scheduler=lr_scheduler,
        dist_init_required=True,
    )

    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()

    # Train!
    print_rank_0("***** Running training *****", args.global_rank)
    print_rank_0(
        f"***** Evaluating perplexity, Epoch {0}/{args.num_train_epochs} *****", args.global_rank
    )
    perplexity, eval_loss = evaluation(model, eval_dataloader)
    print_rank_0(f"ppl: {perplexity}, loss: {eval_loss}", args.global_rank)

    for epoch in range(args.num_train_epochs):
        print_rank_0(
            f"Beginning of Epoch {epoch + 1}/{args.num_train_epochs}, Total Micro Batches "
            f"{len(train_dataloader)}",
            args.global_rank,
        )
        model.train()
        for step, batch in enumerate(train_dataloader):
            start = time.time()
            batch = to_device(batch, device)
            outputs = model(**batch, use_cache=False)
            loss = outputs.loss
            if args.print_loss:
                print(
                    f"Epoch: {epoch}, Step: {step}, Rank: {torch.distributed.get_rank()}, loss = "
                    f"{loss}"
                )
            model.backward(loss)
            model.step()
            end = time.time()
            if torch.distributed.get_rank() == 0:
                print_throughput(model.model, args, end - start, args.global_rank)

        print_rank_0(
            f"***** Evaluating perplexity, Epoch {epoch + 1}/{args.num_train_epochs} *****",
            args.global_rank,
        )
        perplexity, eval_loss = evaluation(model, eval_dataloader)
        print_rank_0(f"ppl: {perplexity}, loss: {eval_loss}", args.global_rank)
        model.tput_timer.update_epoch_count()

    if args.output_dir is not None:
        print_rank_0("saving the final model ...", args.global_rank)
        if args.global_rank == 0:
            save_hf_format(model, args)
        if args.zero_stage == 3:
            # For zero stage 3, each gpu only has a part of the model, so we need a special save
            # function
            save_zero_three_model(
                model, args.global_rank, args.output_dir, zero_stage=args.zero_stage
            )
        model.save_checkpoint(args.output_dir)  # every rank: DeepSpeed's save is collective
        if deepspeed.comm.get_rank() == 0:
            print(
                f"saved DeepSpeed checkpoint to {args.output_dir} after {model.global_steps} steps "
                f"({model.tput_timer.epoch_count} epochs)"
            )


if __name__ == "__main__":
    main()
