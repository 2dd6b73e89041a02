"""``megatrain-ds plan``: predict host RAM, disk and GPU memory before anything is built.

    megatrain-ds plan qwen2.5-7b --tokens-per-step 16384 --seq 1024
    megatrain-ds plan ./my-model --config ds_config.json --seq 4096 --gpus 2 --json

This module owns the plan of a *model*: ``plan_model`` splits it (built on the meta device, or a
real one it does not change) by ``model_map`` exactly as the engine splits it, makes its optimizer
groups as ``initialize`` makes them, measures the step's GPU working set on a meta twin
(plan_gpu.py), and hands the layouts to capacity.py's ``check_capacity``, which resolves the run's
decisions (decisions.py, the engine's own resolver) and counts every byte the engine will hold
(host_bytes.py). Reading MODEL (``load_model_config``, ``meta_model``) and the config
(``load_train_config``, config.py's own parse) is here too; the command line around them (the
arguments, the output) is plan_cli.py. The byte model's names (``check_capacity``,
``CapacityError``, ``Prediction``, ``nvme_split``, ``host_budget_bytes``, ...) are importable from
here as well: the memory model itself is described in capacity.py's docstring (docs/plan.md).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from .capacity import CapacityError, Prediction, check_capacity  # noqa: F401 (re-exported)

# re-exported
from .config import ConfigError, TrainConfig, load_config_source, parse_config  # noqa: F401
from .decisions import liger_setting
from ..parallel import Topology, resident_positions

# re-exported
from .host_bytes import GiB, host_budget_bytes, meminfo, nvme_layer_bytes, nvme_split  # noqa: F401
from ..model import fused_loss_parts, build_layout, find_block_list, shared_parameter_ids
from .plan_gpu import ActivationModel, liger_installed, meta_twin  # noqa: F401 (re-exported)


# ----------------------------------------------------------------------------- MODEL and the config
def load_model_config(spec: str, layers: int | None = None):
    """(display name, transformers config) for MODEL: a shape name
    (megatrain_ds/planning/shapes.py), a folder with a config.json, a config.json path, or a hub id
    whose config is in the local Hugging Face cache."""
    from transformers import AutoConfig

    from . import shapes

    if os.path.isdir(spec) or os.path.isfile(spec):
        path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
        if not os.path.isfile(path):
            raise SystemExit(f"megatrain-ds plan: {spec} has no config.json")
        try:
            cfg = AutoConfig.from_pretrained(path)
        except Exception as exc:
            raise SystemExit(f"megatrain-ds plan: cannot read {path}: {exc}") from None
        return _with_layers(cfg, layers), spec
    if spec in shapes.SHAPE_NAMES:
        return shapes.make_config(spec, layers=layers), spec
    try:
        cfg = AutoConfig.from_pretrained(spec, local_files_only=True)
    except Exception as exc:
        raise SystemExit(
            f"megatrain-ds plan: {spec!r} is not a harness shape ({', '.join(shapes.SHAPE_NAMES)}"
            "), a "
            f"folder with config.json, a config.json path, or a hub id in the local Hugging Face "
            "cache "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:300]})"
        ) from None
    return _with_layers(cfg, layers), spec


def _with_layers(cfg, layers: int | None):
    if layers is not None:
        for key in ("num_hidden_layers", "n_layer", "num_layers"):
            if hasattr(cfg, key):
                setattr(cfg, key, int(layers))
                break
    return cfg


def meta_model(cfg) -> nn.Module:
    """The model of a transformers config on the meta device: a causal LM, or a sequence classifier
    when the config names one."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

    archs = getattr(cfg, "architectures", None) or []
    order = [AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModel]
    if any(a.endswith("ForSequenceClassification") for a in archs):
        order = [AutoModelForSequenceClassification, AutoModelForCausalLM, AutoModel]
    errors = []
    for auto in order:
        try:
            with torch.device("meta"):
                return auto.from_config(cfg)
        except Exception as exc:  # ValueError: unrecognized configuration class for this auto class
            errors.append(f"{auto.__name__}: {str(exc).splitlines()[0][:200]}")
    raise SystemExit(
        "megatrain-ds plan: cannot build the model on the meta device: " + "; ".join(errors)
    )


def load_train_config(source, world: int = 1) -> TrainConfig:
    """A DeepSpeed config (dict or path) parsed by config.py's own ``parse_config`` (bad keys fail
    as in initialize)."""
    return parse_config(load_config_source(source), world_size=world, warn=False)


# ------------------------------------------------------------------------------------- from a model
def _trainable(model: nn.Module, config: TrainConfig, model_parameters=None) -> dict[int, int]:
    """id -> optimizer group, as engine_build.param_groups makes them (none without an
    optimizer)."""
    if config.optimizer is None:
        return {}
    items = list(model.parameters() if model_parameters is None else model_parameters)
    if not items or not isinstance(items[0], dict):
        items = [{"params": items}]
    return {id(p): g for g, item in enumerate(items) for p in item["params"] if p.requires_grad}


def _loss_kind(model: nn.Module, config: TrainConfig, gpu: bool) -> tuple[str, tuple | None]:
    """How the engine computes the loss of a ``labels=`` forward, and (LM head, input embedding)."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    head = (
        base.get_output_embeddings()
        if callable(getattr(base, "get_output_embeddings", None))
        else None
    )
    embedding = (
        base.get_input_embeddings()
        if callable(getattr(base, "get_input_embeddings", None))
        else None
    )
    name = type(base).__name__
    if not isinstance(head, nn.Linear) or not (
        name.endswith("ForCausalLM") or name.endswith("LMHeadModel")
    ):
        return "none", None
    fused = (
        config.megatrain.fused_loss
        and fused_loss_parts(model) is not None
        and not getattr(getattr(base, "config", None), "output_router_logits", False)
    )
    if not fused:
        return "model's own", (head, embedding)
    if gpu and config.megatrain.use_liger and liger_installed():
        return "liger", (head, embedding)
    return "torch", (head, embedding)


def _liger_kernels_apply(model: nn.Module, config: TrainConfig, gpu: bool) -> bool:
    """engine_build.apply_liger_kernels' decision, on this machine."""
    setting = liger_setting(config)  # the resolver's rule ("auto" in fp32 compute: off)
    if not gpu or setting is False or not liger_installed():
        return False
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except Exception:
        return False
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    return (
        getattr(getattr(base, "config", None), "model_type", None) in MODEL_TYPE_TO_APPLY_LIGER_FN
    )


def plan_model(
    model: nn.Module,
    config: TrainConfig,
    *,
    seq: int | None = None,
    device="cuda",
    world: int = 1,
    nvme_path: str | None = None,
    host_budget=None,
    gpu_memory: int | None = None,
    model_parameters=None,
    name: str | None = None,
    raise_error: bool = False,
    nodes: int = 1,
    sharding: str | None = None,
) -> Prediction:
    """The plan for ``model`` (built on the meta device, or a real model: it is not changed, its
    weights are not copied) trained with ``config`` and ``model_parameters`` (as given to
    initialize): layouts and resident parameters exactly as the engine makes them; with ``seq``, the
    GPU working set measured on a meta copy. ``world``: data-parallel ranks per host, on ``nodes``
    hosts; what one host holds follows ``sharding`` (``megatrain.host_sharding`` when None; dp.py's
    ``Topology``: "node" a whole copy per host, "job" 1/nodes)."""
    device = torch.device(device)
    gpu = device.type == "cuda"
    group_of = _trainable(model, config, model_parameters)
    block_name, layers = find_block_list(model)
    shared_ids = shared_parameter_ids(model, layers)
    layouts = [build_layout(i, layer, group_of, shared_ids) for i, layer in enumerate(layers)]
    layer_ids = {id(p) for layer in layers for p in layer.parameters()} - shared_ids
    resident = [
        (p.numel(), id(p) in group_of) for p in model.parameters() if id(p) not in layer_ids
    ]
    acts = None
    notes = []
    if seq:
        loss, parts = _loss_kind(model, config, gpu)
        liger = _liger_kernels_apply(model, config, gpu)
        twin = meta_twin(model)
        twin_parts = None
        if parts is not None:  # the same modules in the twin, by name
            names = {id(m): n for n, m in model.named_modules()}
            twin_parts = tuple(
                twin.get_submodule(names[id(m)]) if m is not None and id(m) in names else None
                for m in parts
            )
        twin_ids = {
            id(tp): g
            for (p, g), tp in zip(
                ((p, group_of.get(id(p))) for p in model.parameters()), twin.parameters()
            )
            if g is not None
        }
        try:
            acts = ActivationModel(
                twin,
                block_name,
                layouts,
                seq,
                config.compute_dtype,
                gpu=gpu,
                liger_kernels=liger,
                loss=loss,
                fused_parts=twin_parts,
                trainable_ids=set(twin_ids),
                tiled_mlp=getattr(config.megatrain, "tiled_mlp", False),
            )
            acts.chunk_rows = config.megatrain.loss_chunk_rows
        except Exception as exc:  # a model the meta device cannot run: the host plan still stands
            notes.append(
                f"the GPU working set was not predicted: running the model on the meta device "
                "failed "
                f"({type(exc).__name__}: {str(exc)[:200]})"
            )
            acts = None
        if acts is not None:
            kernels = "liger-kernel's RMSNorm/SwiGLU" if liger else "the model's own norm/MLP"
            notes.append(
                f"kernels planned: {'flash' if acts.flash else 'math'} attention, {kernels}, loss: "
                f"{loss}"
            )
    # host 0: ranks 0..world-1
    topo = Topology.uniform(nodes, world, sharding or config.megatrain.host_sharding)
    positions = resident_positions(resident, topo.size, topo.position_order())
    pred = check_capacity(
        layouts,
        resident,
        config,
        device,
        nvme_path,
        world=world,
        seq=seq if acts else None,
        activations=acts,
        host_budget=host_budget,
        gpu_memory=gpu_memory,
        model_name=name or type(model).__name__,
        raise_error=raise_error,
        owned=[topo.owned_mask(r, len(layouts)) for r in topo.nodes[0]],
        resident_owned=[topo.resident_mask(r, positions) for r in topo.nodes[0]],
    )
    if nodes > 1:
        pred.notes.append(
            f"{nodes} nodes of {world} GPUs, host_sharding "
            f"\"{sharding or config.megatrain.host_sharding}"
            f"\": host bytes are one node's"
        )
    pred.notes.extend(notes)
    return pred
