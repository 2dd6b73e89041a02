"""Building the benchmark models on the host: Hugging Face's init (``hf``), or a fast init for big
shapes (``fast``), and LoRA adapters (peft) on top.

    model = build_model(config, dtype=torch.bfloat16, init="fast", seed=0)
    model = apply_lora(model, r=16)                      # only the adapters train

``hf``: ``AutoModelForCausalLM.from_config`` on ``device`` with the model's own init, then cast.
Every weight gets its own storage and its own random values; on the CPU torch's own init of
Linear and Embedding (which the model's init overwrites) is skipped, and a weight of >= 8M
elements draws its values in chunks on all cores (:func:`_parallel_normal_`: the same
distribution, other values than before 2026-11-30); at 72B that is still 145 GB in bf16.

``fast`` (default for shapes of >= 14 B parameters): the model is constructed with its parameters on
the meta device (buffers such as the rotary ``inv_freq`` are computed for real on the CPU by the
modules' own ``__init__``), then materialized in ``dtype``: the decoder layers on the CPU, the
parameters outside them (embeddings, final norm, LM head) on ``device`` (the GPU in a GPU run:
megatrain_ds keeps them there, so their host copy never exists). The first decoder layer of each
structure and every parameter outside the layers get the model's own ``_init_weights`` (normal draws
spread over the CPU's cores on the CPU), and every other layer's parameters are new ``nn.Parameter``
objects that share the first layer's storage. "layer 0 values repeated": throughput does not depend
on the values, and the host holds one layer plus the embeddings until the training system copies the
layers into its own state (megatrain_ds's host store copies each layer, then frees the module's
view). Anything that writes a layer's weights in place before that copy would write every layer:
nothing in the harness does.
"""

from __future__ import annotations

import contextlib
import math
import os
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from benchmarks.shapes import LORA_TARGETS, n_params

INIT_CHOICES = ("auto", "fast", "hf")
# "auto": fast from this many parameters on (qwen2.5-14b and up, qwen1.5-moe-a2.7b)
FAST_INIT_MIN_PARAMS = 14e9
FAST_INIT = (
    "layer 0 values repeated (HF init of the first layer of each structure and of everything "
    "outside the "
    "layers; the other layers share its storage until the engine copies them)"
)
HF_INIT = "hf (the model's own init, every weight drawn)"
_CHUNK = 1 << 22  # elements per parallel normal draw (16 MB in fp32)


def resolve_init(init: str, config) -> str:
    """``auto`` -> ``fast`` for models of >= FAST_INIT_MIN_PARAMS parameters, else ``hf``."""
    if init not in INIT_CHOICES:
        raise ValueError(f"init must be one of {INIT_CHOICES}, got {init!r}")
    if init != "auto":
        return init
    return "fast" if n_params(config) >= FAST_INIT_MIN_PARAMS else "hf"


def draw_device(config, device: str, init: str, share: float = 0.5) -> str:
    """Where a peer that trains from host memory (FSDP2, Gemini) has its model built: ``device``
    (the init drawn on the GPU, fast) when the init is ``hf`` and the fp32 weights take at most
    ``share`` of the GPU's free memory; else the CPU (``fast`` builds the layers there anyway).
    Drawn on the CPU, ``hf`` is slower (all cores' draws since 2026-11-30: 13.4 s at 7B on 32
    cores, 58-78 s before)."""
    if not device.startswith("cuda") or resolve_init(init, config) != "hf":
        return "cpu"
    return device if 4 * n_params(config) <= share * torch.cuda.mem_get_info()[0] else "cpu"


def build_model(config, dtype: torch.dtype, init: str, seed: int, device: str = "cpu") -> nn.Module:
    """The random-init causal LM of ``config`` with parameters in ``dtype``, in training mode.

    ``init`` "hf": built on ``device`` (seeded with ``seed``); fp32 is built as before
    (``from_config`` then ``.float()``), other dtypes are built in that dtype. "fast": built on the
    CPU whatever ``device`` (module docstring; the parameters outside the decoder layers on
    ``device``). "auto": see :func:`resolve_init`."""
    init = resolve_init(init, config)
    torch.manual_seed(seed)
    if init == "hf":
        on_cpu = torch.device(device).type == "cpu"
        # on the CPU (2026-11-30, a 7B layer on 2 cores: 13 s of torch's own uniform draws that the
        # model's init overwrites, 8 s of one-core normal draws; the 7B build 58-78 s on 32 cores):
        # torch's default init of Linear and Embedding is skipped and the model's normal draws are
        # spread over the cores; every such weight must then be one the model's init drew
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.device(device))
            drawn = stack.enter_context(_parallel_normal()) if on_cpu else None
            if drawn is not None:  # the draws are seen: torch's own can be skipped
                stack.enter_context(_no_torch_default_init())
            if dtype == torch.float32:
                model = AutoModelForCausalLM.from_config(config).float()
            else:
                model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        if drawn is not None:
            _check_drawn(model, drawn)
        return model.train()
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    _materialize_fast(model, torch.device(device))
    return model.train()


def init_description(init: str) -> str:
    return FAST_INIT if init == "fast" else HF_INIT


# ---------------------------------------------------------------------------------------- fast init
@contextlib.contextmanager
def _parameters_on_meta():
    """Every parameter registered inside goes to the meta device (no storage); buffers stay where
    they were made (the CPU), so non-persistent ones (rotary ``inv_freq``) hold their real values.
    The parameter's CPU tensor is allocated by the module's constructor and dropped at once: no page
    of it is ever touched."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def _materialize_fast(model: nn.Module, rest_device: torch.device) -> None:
    """Give every meta parameter storage (see the module docstring): the layers' on the CPU, the
    others' on ``rest_device``. The first layer of each structure and the parameters outside the
    layers get the model's ``_init_weights``, the other layers share storage with the first layer of
    their structure. Tied parameters stay tied."""
    layers = model.model.layers
    in_layers = {id(m) for m in layers.modules()}
    # id(meta param) -> (meta param, new param)
    replaced: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
    first_of: dict[tuple, nn.Module] = {}
    with torch.no_grad(), _parallel_normal():
        for layer in layers:
            signature = tuple(
                (n, tuple(p.shape), p.dtype)
                for n, p in layer.named_parameters(remove_duplicate=False)
            )
            first = first_of.get(signature)
            if first is None:
                first_of[signature] = layer
                for module in layer.modules():
                    _materialize(module, replaced)
                for module in layer.modules():
                    model._init_weights(module)
            else:
                _share(layer, first, replaced)
        rest = [m for m in model.modules() if id(m) not in in_layers]
        for module in rest:
            _materialize(module, replaced, rest_device)
        for module in rest:
            model._init_weights(module)
    meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if meta:
        raise RuntimeError(
            f"fast init left {len(meta)} parameter(s) on the meta device, e.g. {meta[:3]}"
        )


def _materialize(
    module: nn.Module, replaced: dict, device: torch.device = torch.device("cpu")
) -> None:
    """``module``'s own meta parameters -> new parameters on ``device`` (uninitialized); one new
    parameter per meta one."""
    for name, p in list(module._parameters.items()):
        if p is None or p.device.type != "meta":
            continue
        if id(p) not in replaced:
            new = nn.Parameter(
                torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad
            )
            replaced[id(p)] = (p, new)
        module._parameters[name] = replaced[id(p)][1]


def _share(layer: nn.Module, first: nn.Module, replaced: dict) -> None:
    """``layer``'s parameters -> new parameters viewing ``first``'s storage (same names and
    shapes)."""
    source = {n: p for n, p in first.named_parameters(remove_duplicate=False)}
    for prefix, module in layer.named_modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in replaced:
                data = source[f"{prefix}.{name}" if prefix else name].detach()
                replaced[id(p)] = (p, nn.Parameter(data, requires_grad=p.requires_grad))
            module._parameters[name] = replaced[id(p)][1]


def _parallel_normal_(
    tensor: torch.Tensor,
    mean: float = 0.0,
    std: float = 1.0,
    generator=None,
    *,
    original,
    drawn: set | None = None,
):
    """``normal_`` drawn in 4M-element chunks on all cores, each chunk from its own generator
    seeded from the global one (reproducible for a given seed, whatever the core count). Small,
    strided or non-CPU tensors, or a given generator: ``original``. ``drawn`` collects the data
    pointers of the tensors drawn."""
    if drawn is not None:
        drawn.add(tensor.data_ptr())
    if (
        generator is not None
        or tensor.device.type != "cpu"
        or not tensor.is_contiguous()
        or tensor.numel() < 2 * _CHUNK
    ):
        return original(tensor, mean=mean, std=std, generator=generator)
    seed = int(torch.randint(2**62, (1,)))
    flat, chunks = tensor.detach().view(-1), math.ceil(tensor.numel() / _CHUNK)

    def fill(k: int) -> None:  # grad mode is per thread: detached above, no graph in any thread
        flat[k * _CHUNK : (k + 1) * _CHUNK].normal_(
            mean, std, generator=torch.Generator().manual_seed(seed + k)
        )

    with ThreadPoolExecutor(max_workers=min(chunks, os.cpu_count() or 1)) as pool:
        list(pool.map(fill, range(chunks)))  # each normal_ releases the GIL
    return tensor


@contextlib.contextmanager
def _parallel_normal():
    """Inside: transformers' init helpers draw normal values with :func:`_parallel_normal_`;
    yields the set of data pointers they drew (best effort: a transformers without
    ``initialization.TORCH_INIT_FUNCTIONS`` keeps its own single-threaded draws: None)."""
    try:
        from transformers import initialization

        table = initialization.TORCH_INIT_FUNCTIONS
        original = table["normal_"]
    except (ImportError, AttributeError, KeyError):
        yield None
        return
    drawn: set[int] = set()
    table["normal_"] = lambda tensor, mean=0.0, std=1.0, generator=None: _parallel_normal_(
        tensor, mean, std, generator, original=original, drawn=drawn
    )
    try:
        yield drawn
    finally:
        table["normal_"] = original


@contextlib.contextmanager
def _no_torch_default_init():
    """Inside: ``nn.Linear`` and ``nn.Embedding`` skip torch's own init (their weights stay as
    allocated until the model's init draws them; :func:`_check_drawn` then makes sure it did)."""
    saved = {cls: cls.reset_parameters for cls in (nn.Linear, nn.Embedding)}
    for cls in saved:
        cls.reset_parameters = lambda self: None
    try:
        yield
    finally:
        for cls, method in saved.items():
            cls.reset_parameters = method


def _check_drawn(model: nn.Module, drawn: set) -> None:
    """Every Linear and Embedding weight of ``model`` was drawn by the model's init (else torch's
    skipped init left it as allocated: refused by name)."""
    missed = [
        name
        for name, module in model.named_modules()
        if isinstance(module, (nn.Linear, nn.Embedding)) and module.weight.data_ptr() not in drawn
    ]
    if missed:
        raise RuntimeError(
            f"hf init on the CPU: {len(missed)} weight(s) the model's init did not draw, e.g. "
            f"{missed[:3]} (torch's own init was skipped for them)"
        )


# --------------------------------------------------------------------------------------------- LoRA
def lora_targets(spec: str) -> list[str] | str:
    """h2h --lora-targets: "default" (q, k, v, o, gate, up, down), "all-linear" (peft's own choice:
    every linear but the output layer) or a comma-separated list of module names."""
    if spec == "default":
        return list(LORA_TARGETS)
    if spec == "all-linear":
        return spec
    return [t.strip() for t in spec.split(",") if t.strip()]


def apply_lora(model: nn.Module, r: int, targets: str = "default") -> nn.Module:
    """peft LoRA on ``model``: rank ``r``, alpha 2r, dropout 0, on ``lora_targets(targets)``; only
    the adapters train. The adapters are made in the base weights' dtype
    (``autocast_adapter_dtype=False``: bf16 in a bf16 run, the dtype DeepSpeed's bf16 mode and
    megatrain_ds's bf16 wire compute them in); each system's optimizer keeps their fp32 masters."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=int(r),
        lora_alpha=2 * int(r),
        lora_dropout=0.0,
        target_modules=lora_targets(targets),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config, autocast_adapter_dtype=False)


def lora_settings(r: int, targets: str, model: nn.Module) -> dict:
    """The recorded LoRA settings of a run."""
    adapters = [p for n, p in model.named_parameters() if "lora_" in n]
    return {
        "r": int(r),
        "alpha": 2 * int(r),
        "dropout": 0.0,
        "targets": lora_targets(targets),
        "adapter_dtype": str(adapters[0].dtype).replace("torch.", "") if adapters else None,
        "peft": "get_peft_model(LoraConfig(task_type=CAUSAL_LM), autocast_adapter_dtype=False)",
    }


def param_counts(model: nn.Module) -> dict:
    """Parameter counts (distinct parameters; ZeRO-3 partitioned ones by ``ds_numel``): trainable,
    frozen, adapters (peft ``lora_*``) and base (= all - adapters)."""
    seen: set[int] = set()
    out = {"trainable_params": 0, "frozen_params": 0, "adapter_params": 0, "base_params": 0}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = int(getattr(p, "ds_numel", p.numel()))
        out["trainable_params" if p.requires_grad else "frozen_params"] += n
        out["adapter_params" if "lora_" in name else "base_params"] += n
    return out
