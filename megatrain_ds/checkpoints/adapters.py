"""PEFT adapters (LoRA): saved the way ``peft`` saves them, beside the DeepSpeed checkpoint.

A ``peft.get_peft_model(...)`` model trains through the engine like any other: its base weights are
frozen (no optimizer group), so they live in the host wire copy in the compute dtype only
(host_state.py: 2 bytes per parameter in bf16) and the adapters carry the fp32 master and Adam
state. The module's own parameters hold no storage (the engine owns the weights), so
``model.save_pretrained(dir)`` on its own would write empty tensors, as it would under DeepSpeed
ZeRO-3. ``save_checkpoint`` therefore also writes the adapter into the tag folder with peft's own
``save_pretrained``, given the engine's weights as its ``state_dict`` (peft picks the adapter
entries out of it): ``PeftModel.from_pretrained(base, "<save_dir>/<tag>")`` loads it.
``save_adapter`` does the same into any folder.
"""

from __future__ import annotations

import torch

from .parts import CheckpointParts


def is_peft_model(module: torch.nn.Module) -> bool:
    """A ``peft.PeftModel`` (duck-typed: peft need not be importable to train other models)."""
    return (
        callable(getattr(module, "get_base_model", None))
        and hasattr(module, "peft_config")
        and callable(getattr(module, "save_pretrained", None))
    )


def trained_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """fp32 weights of every parameter of the engine's ``module`` that requires grad (adapters,
    ``modules_to_save``), keyed like its ``state_dict``. Data parallel: a collective (each value
    comes from its owner rank)."""
    out = {}
    for name, p in module.named_parameters():
        home = getattr(p, "megatrain_home", None)
        if p.requires_grad and home is not None:
            out[name] = home.read_master().reshape(getattr(p, "ds_shape", p.shape))
    return out


def save_adapter(parts: CheckpointParts, folder: str, is_main_process: bool | None = None) -> None:
    """Write the adapter of the engine's ``parts.module`` as ``peft``'s ``save_pretrained`` does
    (``adapter_config.json``, ``adapter_model.safetensors``) into ``folder``. Data parallel: every
    rank calls it; rank 0 writes."""
    module = parts.module
    if not is_peft_model(module):
        raise TypeError(
            f"save_adapter: the engine's module is a {type(module).__name__}, not a "
            "peft PeftModel (wrap it with peft.get_peft_model before initialize)"
        )
    state = trained_state_dict(module)
    main = (parts.dp is None or parts.dp.rank == 0) if is_main_process is None else is_main_process
    if main:
        module.save_pretrained(folder, state_dict=state, is_main_process=True)
