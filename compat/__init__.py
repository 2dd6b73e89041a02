"""DeepSpeed launches that run on megatrain_ds without a change to the script, config or accelerate yaml.

    MEGATRAIN_DS=1 accelerate launch --config_file ds_zero3.yaml train.py
    MEGATRAIN_DS=1 torchrun --nproc_per_node 1 train_with_trainer.py      # Trainer(args=TrainingArguments(deepspeed=...))

switch.py             the opt-in, run at interpreter start by the ``megatrain_ds_switch.pth`` the package installs
import_hook.py        runs a function on a module right after its first import
deepspeed_redirect.py what changes in the real ``deepspeed`` package once it is imported, and why

Off by default: without ``MEGATRAIN_DS=1`` nothing here is imported and DeepSpeed is untouched.
"""
