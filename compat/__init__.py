"""DeepSpeed launches that run on megatrain_ds without a change to the script, config or accelerate
yaml.

    # num_processes: N as usual
    MEGATRAIN_DS=1 accelerate launch --config_file ds_zero3.yaml train.py
    # Trainer(args=TrainingArguments(deepspeed=...))
    MEGATRAIN_DS=1 torchrun --nproc_per_node N train_with_trainer.py
    # pdsh: every host's ranks get the switch
    MEGATRAIN_DS=1 deepspeed --hostfile hosts train.py

Any number of processes: each rank reaches megatrain_ds's engine, which trains data-parallel over
accelerate's (or the Trainer's) process group (megatrain_ds/parallel/dp.py).

The modules:

- switch.py: the opt-in, run at interpreter start by the ``megatrain_ds_switch.pth`` the package
  installs;
- env.py: the switch's environment variable;
- import_hook.py: runs a function on a module right after its first import;
- deepspeed_redirect.py: what changes in the real ``deepspeed`` package once it is imported, and
  why;
- accelerate_world.py: what changes in accelerate (its process count for DeepSpeed on a CPU-only
  machine), and why;
- launcher_env.py: what changes in DeepSpeed's multi-node runner (it exports MEGATRAIN_DS to every
  host), and why.

Off by default: without ``MEGATRAIN_DS=1`` nothing here is imported and DeepSpeed is untouched.
"""
