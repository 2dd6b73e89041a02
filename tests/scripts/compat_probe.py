"""Probes of the MEGATRAIN_DS switch, each run by tests/integration/test_compat.py in a fresh
interpreter (the switch acts at interpreter start). Prints one JSON line.

    python compat_probe.py startup               what the interpreter imported at start; what
        deepspeed is
    python compat_probe.py zero3-init MODEL_DIR  from_pretrained under HfDeepSpeedConfig (ZeRO-3),
        no launcher
    python compat_probe.py errors                unsupported setups under MEGATRAIN_DS=1, and their
        messages
"""

import json
import sys

AT_START = sorted(
    m for m in ("compat", "compat.switch", "torch", "deepspeed", "megatrain_ds") if m in sys.modules
)


def startup() -> dict:
    import deepspeed

    return {
        "at_start": AT_START,
        "initialize": f"{deepspeed.initialize.__module__}.{deepspeed.initialize.__name__}",
        "engine": f"{deepspeed.DeepSpeedEngine.__module__}.{deepspeed.DeepSpeedEngine.__name__}",
        "zero_init": deepspeed.zero.Init.__module__,
        "cpu_adam": deepspeed.ops.adam.DeepSpeedCPUAdam.__module__,
    }


def zero3_init(model_dir: str) -> dict:
    import safetensors.torch
    import torch
    import transformers
    from transformers.integrations import HfDeepSpeedConfig

    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
    }
    keep_alive = HfDeepSpeedConfig(config)  # noqa: F841 (transformers holds a weak reference)
    entered = []
    init_cls = deepspeed.zero.Init

    class Recording(init_cls):
        def __enter__(self):
            entered.append(init_cls.__module__)
            return super().__enter__()

    deepspeed.zero.Init = Recording
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    saved = safetensors.torch.load_file(f"{model_dir}/model.safetensors")
    state = model.state_dict()
    return {
        "zero_init_entered": entered,
        "devices": sorted({p.device.type for p in model.parameters()}),
        "whole": all(p.numel() > 0 for p in model.parameters()),
        "equal_to_saved": all(torch.equal(state[k], v) for k, v in saved.items()),
        "dist_initialized": torch.distributed.is_initialized(),
        "ds_rank": deepspeed.comm.get_rank(),
    }


def errors() -> dict:
    import os

    import torch
    import transformers

    import deepspeed

    def model():
        cfg = transformers.LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=64,
        )
        return transformers.LlamaForCausalLM(cfg)

    adam = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"}}
    cases = {
        "sgd_config": lambda: deepspeed.initialize(
            model=model(), config={**adam, "optimizer": {"type": "SGD"}}
        ),
        "sgd_client": lambda: deepspeed.initialize(
            model=model(),
            config={"train_micro_batch_size_per_gpu": 1},
            optimizer=torch.optim.SGD(model().parameters(), lr=0.1),
        ),
        "adagrad": lambda: deepspeed.ops.adagrad.DeepSpeedCPUAdagrad(model().parameters()),
    }
    out = {}
    for name, call in cases.items():
        os.environ["WORLD_SIZE"] = "1"
        try:
            call()
            out[name] = None
        except Exception as exc:  # the test reads the type and the message
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


if __name__ == "__main__":
    mode = sys.argv[1]
    result = {"startup": startup, "errors": errors}.get(mode)
    print(json.dumps(result() if result else zero3_init(sys.argv[2])))
