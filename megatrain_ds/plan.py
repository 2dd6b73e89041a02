"""``megatrain-ds plan``: predict host RAM, disk and GPU memory before anything is built.

    megatrain-ds plan qwen2.5-7b --tokens-per-step 16384 --seq 1024
    megatrain-ds plan ./my-model --config ds_config.json --seq 4096 --gpus 2 --json

The model is built on the meta device (no storage), split by ``model_map`` exactly as the engine splits it, and
every byte the engine will hold is counted from the layouts, by the same rules as the code that allocates it.
``check_capacity`` is the same computation for the engine itself, called before it builds its buffers: the CLI and
the engine print the same table and refuse for the same reasons. This module is the byte model (what the engine
calls, and ``plan_model`` for a built model); the command line (reading MODEL and the config, the arguments, the
output) is plan_cli.py, whose names (``main``, ``load_model_config``, ``meta_model``, ``load_train_config``, ...)
this module still answers for.

The model of memory
-------------------

**Host RAM** (persistent; ``host_state_bytes`` equals ``engine.host_memory()["total_bytes"]`` summed over ranks,
to the byte: tests/test_plan.py):

- ``HostLayerStore`` (host_state.py), for the streamed layers a rank owns (data parallel: layer i on rank i % N,
  so the layers are held once per host): the master (fp32; bf16 with ``bf16_master_weights_and_grads``), whole
  layers when it is the wire copy, else the trainable elements only (frozen weights live in the wire copy only);
  exp_avg and exp_avg_sq (fp32, trainable); the wire copy (all elements, in the wire dtype; none when the wire is
  the master); the gradient home (trainable elements, in the landing dtype with GA 1, fp32 with GA > 1); with
  GA > 1, a landing ring of 4 slabs of the largest layer's trainable region (wire dtype) plus an fp32 scratch.
- The NVMe tier (``zero_optimization.offload_optimizer.device: nvme``, nvme.py): the Adam moments of a suffix of
  the streamed layers leave RAM for the disk (``nvme_split`` picks how many; the engine calls it through
  ``engine_nvme_layers``); RAM gains ``max(2, buffer_count)`` staging buffers of the largest disk layer's region.
- ``ResidentParams`` (optimizer.py), once per rank (replicated): per trainable element fp32 master, exp_avg,
  exp_avg_sq and gradient (16 bytes) plus a pinned compute-dtype wire copy and landing buffer (2 x 2 bytes in bf16);
  nothing on the host when that state is on the GPU (``gpu_optimizer_layers`` > 0 at initialize), and nothing for a
  frozen one (its only copy is on the device). On a CPU "device" the device copies are host memory too.
- Beside the state (not in ``host_memory()``): the host optimizer's fp32 scratch (one layer; two in bf16-master
  mode), and, with
  ``offload_activations``, every layer's saved input in pinned host memory (a buffer of exactly its size each,
  activations.py), per step.

**Disk**: per disk layer ``2 * align(4 * n_train, 4096)`` (exp_avg and exp_avg_sq, page aligned); ``3 *`` with
masters on NVMe (``offload_param.device: nvme``), whose masters then leave RAM as well.

**GPU** (per rank; ``gpu_allocated_bytes`` is what ``torch.cuda.max_memory_allocated`` reports for a step):

- persistent: ``num_slots`` weight slots of the largest layer in the compute dtype, each with an fp32 staging
  buffer when the fp32 master streams (``stream_fp32_master``); the kept layers' own weight buffers; the resident
  parameters' compute-dtype copies (and their fp32 state, with GPU-held optimizer state); the GPU-held layers'
  state (``gpu_optimizer_layers`` > 0: 4 bytes per master element + 12 per trainable one); the cuBLAS workspace;
  the batch and the layer-call arguments (rotary tables).
- per phase of the step, the largest of: the forward of layer j (inputs saved so far + its no-grad forward); the
  loss forward and backward (every saved input + the final norm's graph + the LM head and cross-entropy); the
  backward of layer j (inputs of layers <= j + the LM head's gradient + the incoming gradient + the previous
  layer's flat gradient still on its way to the host + layer j's recompute-and-gradient working set); the landing
  of layer j's gradient (its conversion to the landing dtype); the embedding's backward.
- The per-layer working sets, the final norm's graph and the torch-chunked or model's own loss are *measured*
  (plan_gpu.py): the layer runs on the meta device under a dispatch mode that tracks every tensor storage an op
  creates and frees (``_LiveBytes``), as the executor runs it (its template, bound to a flat slot, tiled by tiling.py
  when ``tiled_mlp`` says so). The live total at each moment is linear in the micro-batch, so two runs (micro-batch 1
  and 2) give the peak at any micro-batch. Emulated, because they differ on a GPU: attention with no mask runs as
  flash attention (output + fp32 log-sum-exp saved; the backward's fp32 dq accumulator; fp32 with grouped KV heads
  falls back to the math kernel, measured as such); when liger-kernel applies (CUDA, installed, a model type it
  knows), its RMSNorm and SwiGLU (what they save, in-place backward); autograd adds a second gradient into the first
  in place on real devices (not on meta). liger's fused linear cross-entropy is computed from its chunking rule
  (transient logits of about tokens x hidden; fp32 head-gradient accumulator).
- Not allocated by torch, so added to what must fit, not to ``gpu_allocated_bytes``: the CUDA context and
  kernels (``CUDA_CONTEXT_BYTES``), NCCL's buffers with several ranks. The largest micro-batch keeps
  ``GPU_HEADROOM`` of the rest free for the caching allocator's fragmentation.
- Not predicted: what ``"auto"`` places after the first step (kept layers, GPU-held optimizer state) in the memory
  that step left free; the inference cache (no-grad forwards); a host that launches kernels several layers ahead
  of the GPU can hold more than one flat gradient in flight (one is counted).
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from .config import ConfigError, TrainConfig
from .host_update import lands_fp32, resolve_kernel
from .model_map import LayerLayout, build_layout, find_block_list, shared_parameter_ids
from .plan_gpu import _DTYPES, ActivationModel, _liger_installed, _meta_twin, _size  # noqa: F401 (re-exported)

GiB = 2 ** 30
MiB = 2 ** 20
NVME_ALIGN = 4096  # disk layers' moments are page aligned (O_DIRECT)
NVME_BUFFER_COUNT = 4  # DeepSpeed's offload_optimizer.buffer_count default
HOST_RESERVE_FRACTION = 0.05  # host_memory_budget "auto": MemAvailable - 5% of MemTotal
CUDA_CONTEXT_BYTES = 768 * MiB  # CUDA context, loaded kernels, cuDNN/cuBLAS handles (an estimate; not torch's)
NCCL_BYTES = 512 * MiB  # NCCL's own buffers per rank with several ranks (an estimate; not torch's)
CUBLAS_WORKSPACE_BYTES = 32 * MiB  # torch's cuBLAS workspace on the compute stream, Hopper (torch's allocator)
CUBLAS_WORKSPACE_BYTES_PRE_HOPPER = 4096 * 1024 * 2 + 16 * 1024 * 8  # torch's default before sm90
GPU_HEADROOM = 0.05  # of the memory left after the context: the caching allocator's fragmentation
_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class CapacityError(RuntimeError):
    """The predicted memory clearly exceeds what this machine has; the message gives the numbers (needed vs
    available per tier), which limit binds and what to change. ``prediction`` holds the whole plan."""

    def __init__(self, message: str, prediction: "Prediction") -> None:
        super().__init__(message)
        self.prediction = prediction


# ---------------------------------------------------------------------------------------------------- NVMe tier
def align(n: int, to: int = NVME_ALIGN) -> int:
    return -(-int(n) // to) * to


def nvme_layer_bytes(n_train: int, masters: bool = False) -> int:
    """Disk bytes of one disk layer: exp_avg and exp_avg_sq (fp32), and with ``masters`` its fp32 master, each page
    aligned (nvme.layer_disk_bytes)."""
    return (3 if masters else 2) * align(4 * n_train)


def nvme_split(ram_bytes_without_moments: int, moment_bytes: list[int], staging_count: int, budget: int,
               setting, masters: bool = False) -> int:
    """How many trailing streamed layers keep their Adam moments on disk.

    ``ram_bytes_without_moments``: host RAM with no layer's moments in it (and no staging); ``moment_bytes[i]``:
    what layer i's disk placement takes out of RAM (``8 * n_train_i``, ``12 *`` with ``masters``: the fp32 master
    goes too; 0 for a layer this rank does not hold); ``staging_count``: the
    staging buffers the tier allocates (``staging_buffers(offload_optimizer.buffer_count)``), each the size of the
    largest disk layer's region (``nvme_layer_bytes``; none without a disk layer); ``budget``: host bytes allowed
    (``host_budget_bytes``); ``setting``:
    ``megatrain.nvme_layers``, an int (that many trailing layers, at most all) or "auto"/None (the fewest trailing
    layers with which RAM fits the budget; all of them when nothing fits: the caller then refuses). Pure."""
    n = len(moment_bytes)
    if setting is None or setting == "auto":
        kept = sum(moment_bytes)  # moments still in RAM with k trailing disk layers
        largest = 0  # the largest disk layer's moments on disk
        for k in range(n + 1):
            if k:
                m = moment_bytes[n - k]
                kept -= m
                largest = max(largest, nvme_layer_bytes(m // (12 if masters else 8), masters))
            if ram_bytes_without_moments + kept + staging_count * largest <= budget:
                return k
        return n
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 0:
        raise ConfigError(f"megatrain.nvme_layers must be a layer count >= 0 or \"auto\", got {setting!r}")
    return min(setting, n)


def meminfo() -> tuple[int, int]:
    """(MemAvailable, MemTotal) in bytes, from /proc/meminfo (sysconf where there is none)."""
    values = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, rest = line.split(":", 1)
                values[key] = int(rest.split()[0]) * 1024
    except OSError:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
    return values.get("MemAvailable", values.get("MemFree", 0)), values.get("MemTotal", 0)


def host_budget_bytes(setting, freed_bytes: int = 0) -> int:
    """Host bytes the engine's state may take. ``setting`` (``megatrain.host_memory_budget``): a number of GiB, or
    "auto"/None = MemAvailable - 5% of MemTotal, measured now, plus ``freed_bytes`` (what the caller will free
    before the state fills: the engine passes the bytes of the model's own weights, which ``load_layer`` releases;
    a fresh process passes 0). Pure but for the read of /proc/meminfo."""
    if setting is None or setting == "auto":
        available, total = meminfo()
        return max(0, int(available + freed_bytes - HOST_RESERVE_FRACTION * total))
    if isinstance(setting, bool) or not isinstance(setting, (int, float)) or not setting > 0:
        raise ConfigError(f"megatrain.host_memory_budget must be a number of GiB > 0 or \"auto\", got {setting!r}")
    return int(setting * GiB)


def disk_free_bytes(path: str | None) -> int | None:
    """Free bytes (for an unprivileged user) of the file system holding ``path`` (its nearest existing parent)."""
    if not path:
        return None
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


# ------------------------------------------------------------------------------------------ engine decisions
def nvme_settings(config: TrainConfig) -> tuple[bool, str | None, int]:
    """(NVMe tier on, nvme_path, buffer_count) from ``zero_optimization.offload_optimizer`` (config.nvme when
    config.py parses it, else the raw dict)."""
    parsed = getattr(config, "nvme", None)
    if parsed is not None:
        return True, parsed.nvme_path or None, int(parsed.buffer_count)
    block = ((config.raw.get("zero_optimization") or {}).get("offload_optimizer") or {})
    on = block.get("device") == "nvme"
    return on, block.get("nvme_path") or None, int(block.get("buffer_count", NVME_BUFFER_COUNT))


def nvme_masters(config: TrainConfig) -> bool:
    """Whether the NVMe layers' fp32 masters go to disk too (``offload_param.device: nvme`` beside the tier)."""
    parsed = getattr(config, "nvme", None)
    return bool(parsed is not None and getattr(parsed, "masters", False))


def staging_buffers(buffer_count: int) -> int:
    """Staging buffers the NVMe tier allocates for ``offload_optimizer.buffer_count`` (nvme.NvmeMoments: one being
    updated, one being read or written, at least)."""
    return max(2, int(buffer_count))


@dataclass(slots=True)
class Decisions:
    """What the engine decides at initialize from the config and the layouts (engine.py, host_state.py)."""

    compute: str  # "bf16" | "fp16" | "fp32"
    wire: str  # what crosses PCIe and is kept for frozen weights: the fp32 master or the compute dtype
    master: str  # the streamed layers' master weights: "fp32", or the compute dtype (bf16_master_weights_and_grads)
    grad: str  # the gradient home's dtype (GA 1), or "fp32" (GA > 1: an fp32 accumulator)
    ga: int
    n_device_layers: int  # leading layers whose optimizer state is on the GPU from initialize
    resident_on_device: bool  # the resident parameters' fp32 state is on the GPU from initialize
    keep: int  # kept layers (no recompute) from initialize; "auto" decides after the first step
    notes: list[str] = field(default_factory=list)


def decide(layouts: list[LayerLayout], config: TrainConfig) -> Decisions:
    mt, notes = config.megatrain, []
    compute = config.compute_dtype
    bf16_masters = bool(getattr(config, "bf16_masters", False))
    stream_fp32 = False if (bf16_masters or nvme_masters(config)) else mt.stream_fp32_master
    if stream_fp32 == "auto":  # engine.py: the master, unless most streamed weights are frozen (LoRA)
        stream_fp32 = sum(lay.n_frozen for lay in layouts) <= sum(lay.n_train for lay in layouts)
    wire = "fp32" if stream_fp32 else compute
    ga = config.gradient_accumulation_steps
    fp32_landing = lands_fp32(mt.fp32_grad_landing, stream_fp32, resolve_kernel(mt.host_kernel))
    grad = "fp32" if (ga > 1 or fp32_landing) else compute
    n_device = mt.gpu_optimizer_layers
    if n_device == -1:
        ratio = config.offload_optimizer_ratio
        n_device = "auto" if ratio is None else round((1.0 - ratio) * len(layouts))
    if n_device == "auto":
        n_device = 0
        if config.optimizer is not None and not bf16_masters:
            notes.append("gpu_optimizer_layers \"auto\": after the first step the engine moves optimizer state to "
                         "the GPU memory that step left free (not counted here; host state shrinks by as much)")
    keep = mt.keep_activations
    if keep == "auto":
        keep = 0
        notes.append("keep_activations \"auto\": after the first step, layers whose graph fits in the GPU memory "
                     "left free skip their recompute (not counted here)")
    n_device = min(int(n_device), len(layouts))
    return Decisions(compute, wire, compute if bf16_masters else "fp32", grad, ga, n_device, n_device > 0,
                     min(int(keep), len(layouts)), notes)


# ---------------------------------------------------------------------------------------------- host state
def layer_store_bytes(layouts: list[LayerLayout], owned: list[bool], wire: str, grad: str, ga: int,
                      disk: frozenset[int] = frozenset(), master: str = "fp32", staging_count: int = 0,
                      disk_masters: bool = False) -> dict[str, int]:
    """Bytes of one rank's ``HostLayerStore`` buffers, as host_state.py allocates them (its ``nbytes()``): the moments
    of the ``disk`` layers (NVMe tier, a suffix) are not in RAM, nor their masters with ``disk_masters``;
    ``staging_count`` staging buffers of the largest of this rank's disk layers are (nvme.NvmeMoments, counted by
    ``fixed_nbytes``)."""
    full = sum(lay.numel for lay, mine in zip(layouts, owned) if mine)
    train = sum(lay.n_train for lay, mine in zip(layouts, owned) if mine)
    moments = sum(lay.n_train for i, (lay, mine) in enumerate(zip(layouts, owned)) if mine and i not in disk)
    wire_is_master = wire == master  # the master is the wire copy: whole layers, one copy
    ram_train = moments if disk_masters else train  # an NVMe layer's master is on disk too
    parts = {f"{master} master": _size(master) * (full if wire_is_master else ram_train),  # else trainable only
             "exp_avg + exp_avg_sq": 8 * moments,
             f"{wire} wire copy": 0 if wire_is_master else _size(wire) * full,
             f"{grad} gradients": _size(grad) * train}
    if ga > 1:  # landing ring: 4 slabs of the largest layer (wire dtype) + an fp32 scratch (fixed_nbytes)
        max_train = max((lay.n_train for lay, mine in zip(layouts, owned) if mine), default=0)
        parts["landing ring (GA > 1)"] = 4 * max_train * _size(wire) + 4 * max_train
    on_disk = [lay.n_train for i, (lay, mine) in enumerate(zip(layouts, owned)) if mine and i in disk and lay.n_train]
    parts["NVMe staging buffers"] = staging_count * max((nvme_layer_bytes(n, disk_masters) for n in on_disk),
                                                        default=0)
    return parts


def _resident_items(resident) -> list[tuple[int, bool]]:
    """(elements, trainable) per resident parameter: tensors (trainable = requires_grad), ints (trainable) or
    pairs."""
    out = []
    for item in resident:
        if isinstance(item, torch.Tensor):
            out.append((item.numel(), bool(item.requires_grad)))
        elif isinstance(item, (tuple, list)):
            out.append((int(item[0]), bool(item[1])))
        else:
            out.append((int(item), True))
    return out


def resident_host_bytes(resident: list[tuple[int, bool]], compute: str, device_type: str,
                        state_on_device: bool) -> int:
    """Bytes of one rank's ``ResidentParams`` on the host (counted by ``host_memory()``). Trainable: fp32 master,
    exp_avg, exp_avg_sq, grad (16) + compute-dtype wire and landing copies (pinned in mappings of their own: no 2^k
    rounding), on the host unless the state is on the device; frozen: their one compute-dtype copy is on the device
    (host memory only when the device is the CPU)."""
    c, exact = _size(compute), 0
    for n, trainable in resident:
        if not trainable:
            exact += c * n if device_type == "cpu" else 0
        elif state_on_device:
            exact += 16 * n if device_type == "cpu" else 0
        else:
            exact += (16 + 2 * c) * n
    return exact


def optimizer_scratch_bytes(layouts: list[LayerLayout], owned: list[bool], master: str) -> int:
    """HostAdamW's fp32 scratch of the largest layer (bf16 gradients converted for the fused kernel), and in
    bf16-master mode its fp32 copy of that layer's master: host memory beside ``host_memory()``."""
    max_train = max((lay.n_train for lay, mine in zip(layouts, owned) if mine), default=0)
    return 4 * max_train * (1 if master == "fp32" else 2)


def engine_nvme_layers(config: TrainConfig, layouts: list[LayerLayout], owned: list[bool], wire_dtype: torch.dtype,
                       ga: int, grad_dtype: torch.dtype | None, model: nn.Module, layers: nn.ModuleList) -> int:
    """``megatrain.nvme_layers: "auto"`` for the engine (engine._nvme_layers), before it builds its buffers: the
    fewest trailing layers whose moments go to disk so that this rank's host state fits its share of the budget,
    by ``nvme_split`` over the same bytes ``check_capacity`` counts (this rank's ``HostLayerStore`` without moments,
    its ``ResidentParams`` host tensors, the optimizer's scratch).

    The budget (``host_budget_bytes``) is measured now, while the model's own weights are still in host memory:
    they are freed as the layers load (``load_layer``) and the resident copies move, so their bytes count as
    free. Data parallel: the host's budget is shared by the ``LOCAL_WORLD_SIZE`` ranks on it (each frees its own
    model copy). Trainable = ``requires_grad`` (the engine's optimizer groups, in the common case)."""
    compute = config.compute_dtype
    wire = _NAMES[wire_dtype]
    grad = _NAMES[grad_dtype or wire_dtype] if ga == 1 else "fp32"
    master = compute if getattr(config, "bf16_masters", False) else "fp32"
    device_type = "cuda" if torch.cuda.is_available() else "cpu"  # the engine's default device
    shared = shared_parameter_ids(model, layers)
    layer_ids = {id(p) for layer in layers for p in layer.parameters()} - shared
    resident = [(p.numel(), p.requires_grad) for p in model.parameters() if id(p) not in layer_ids]
    dec = decide(layouts, config)
    all_disk = frozenset(range(len(layouts)))
    masters = nvme_masters(config)
    without = sum(layer_store_bytes(layouts, owned, wire, grad, ga, all_disk, master, disk_masters=masters).values())
    without += resident_host_bytes(resident, compute, device_type, dec.resident_on_device) + \
        optimizer_scratch_bytes(layouts, owned, master)
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized() and \
        torch.distributed.get_world_size() > 1
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)) if distributed else 1
    storages = {}
    for p in model.parameters():
        if p.device.type == "cpu":
            storages[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    budget = host_budget_bytes(config.megatrain.host_memory_budget,
                               freed_bytes=local * sum(storages.values())) // local
    _, _, buffer_count = nvme_settings(config)
    per = 12 if masters else 8
    moment_bytes = [per * lay.n_train if mine else 0 for lay, mine in zip(layouts, owned)]
    return nvme_split(without, moment_bytes, staging_buffers(buffer_count), budget,
                      config.megatrain.nvme_layers, masters)


# ------------------------------------------------------------------------------------------------ the plan
@dataclass
class Prediction:
    """The plan: per tier, what is needed and what this machine has. ``table()`` is what the CLI and the engine
    print; ``to_dict()`` what ``--json`` prints."""

    model: str
    n_layers: int
    params: int
    trainable: int
    compute: str
    wire: str
    grad: str
    ga: int
    micro_batch: int
    seq: int | None
    world: int
    device: str  # "cuda" or "cpu": where the engine computes
    host_parts: dict[str, int]  # engine state parts (summed over ranks), then staging and what is beside it
    host_state_bytes: int  # = engine.host_memory()["total_bytes"] (summed over ranks)
    host_need_bytes: int  # state + NVMe staging + optimizer scratch + offloaded activations
    host_budget_bytes: int
    host_budget_source: str
    host_available_bytes: int
    host_total_bytes: int
    nvme: bool
    nvme_path: str | None
    disk_layers: int
    nvme_masters: bool
    disk_bytes: int
    disk_free_bytes: int | None
    gpu_parts: dict[str, int]  # at the configured micro-batch, in the peak phase
    gpu_phase: str
    gpu_allocated_bytes: int | None  # torch.cuda.max_memory_allocated after a step (None: no sequence length)
    gpu_min_bytes: int  # allocated before any activation (slots, resident, GPU-held state)
    gpu_overhead_bytes: int  # CUDA context, NCCL: not torch's
    gpu_total_bytes: int | None
    gpu_source: str
    max_micro_batch: int | None
    max_micro_batch_limit: str  # what stops a larger micro-batch
    binding: str  # "host RAM", "disk" or "GPU": the tier closest to (or over) its capacity
    fits: bool
    problems: list[str] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def gpu_need_bytes(self) -> int | None:
        """What must fit in the device's memory at the configured micro-batch (context included)."""
        return None if self.gpu_allocated_bytes is None else self.gpu_allocated_bytes + self.gpu_overhead_bytes

    def to_dict(self) -> dict:
        out = asdict(self)
        out["gpu_need_bytes"] = self.gpu_need_bytes
        return out

    def table(self) -> str:
        lines = [f"megatrain-ds plan: {self.model} ({self.n_layers} streamed layers, {_count(self.params)} parameters, "
                 f"{_count(self.trainable)} trainable; {self.compute} compute, {self.wire} wire, {self.grad} "
                 f"gradients, GA {self.ga}; {self.world} {'GPU' if self.device == 'cuda' else 'process'}"
                 f"{'s' if self.world > 1 else ''})"]
        if self.seq:
            lines.append(f"micro-batch {self.micro_batch} x seq {self.seq} = {self.micro_batch * self.seq:,} tokens "
                         f"per {'GPU' if self.device == 'cuda' else 'process'}")
        lines.append("")
        lines.append(f"{'tier':<10}{'needed':>14}{'available':>14}  ")
        host_have = f"{_fmt(self.host_budget_bytes)}"
        lines.append(f"{'host RAM':<10}{_fmt(self.host_need_bytes):>14}{host_have:>14}  "
                     f"budget: {self.host_budget_source}")
        for name, n in self.host_parts.items():
            if n:
                lines.append(f"  {name:<44}{_fmt(n):>12}")
        if self.nvme:
            free = "?" if self.disk_free_bytes is None else _fmt(self.disk_free_bytes)
            what = "fp32 masters and Adam moments" if self.nvme_masters else "Adam moments"
            lines.append(f"{'disk':<10}{_fmt(self.disk_bytes):>14}{free:>14}  {what} of the last "
                         f"{self.disk_layers} layer(s) on {self.nvme_path or '(no nvme_path)'}")
        else:
            free = "" if self.disk_free_bytes is None else f"{_fmt(self.disk_free_bytes)}"
            lines.append(f"{'disk':<10}{_fmt(0):>14}{free:>14}  no NVMe tier "
                         "(zero_optimization.offload_optimizer.device is not nvme)")
        if self.device == "cuda":
            need = "?" if self.gpu_need_bytes is None else _fmt(self.gpu_need_bytes)
            have = _fmt(self.gpu_total_bytes) if self.gpu_total_bytes else "-"
            lines.append(f"{'GPU':<10}{need:>14}{have:>14}  {self.gpu_source}; per GPU, peak in {self.gpu_phase}")
            for name, n in self.gpu_parts.items():
                if n:
                    lines.append(f"  {name:<44}{_fmt(n):>12}")
        else:
            lines.append(f"{'GPU':<10}{'-':>14}{'-':>14}  the engine computes on the CPU: its working set "
                         "is counted in host RAM")
        lines.append("")
        if self.max_micro_batch is not None:
            lines.append(f"largest micro-batch per {'GPU' if self.device == 'cuda' else 'process'} at seq "
                         f"{self.seq}: {self.max_micro_batch} (limited by {self.max_micro_batch_limit})")
        else:
            lines.append(f"largest micro-batch: not known ({self.max_micro_batch_limit})")
        lines.append(f"binding limit: {self.binding}" + ("" if self.fits else "  -- DOES NOT FIT"))
        for p in self.problems:
            lines.append(f"  problem: {p}")
        for a in self.advice:
            lines.append(f"  change: {a}")
        for n in self.notes:
            lines.append(f"  note: {n}")
        return "\n".join(lines)


def _fmt(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n} B"


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return str(n)


def _cublas_workspace_bytes(device: torch.device, gpu_memory: int | None) -> int:
    """The cuBLAS workspace torch allocates per (handle, stream) through its caching allocator: only the compute
    stream runs GEMMs here. ``CUBLAS_WORKSPACE_CONFIG`` (":SIZE_KiB:COUNT" ...) when set; else torch's default for
    the device here (planning for another GPU: Hopper's)."""
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if config:
        try:
            parts = [p for p in config.split(":") if p]
            return sum(int(parts[k]) * 1024 * int(parts[k + 1]) for k in range(0, len(parts) - 1, 2))
        except ValueError:
            pass
    if gpu_memory is None and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        if torch.cuda.get_device_capability(index)[0] < 9:
            return CUBLAS_WORKSPACE_BYTES_PRE_HOPPER
    return CUBLAS_WORKSPACE_BYTES


def _gpu_at(b: int, layouts, dec: Decisions, acts: ActivationModel | None, persistent: dict[str, int],
            offload: bool, device_state_layers: int) -> tuple[int, dict[str, int], str]:
    """(peak allocated bytes, parts at the peak, the phase) for micro-batch ``b``: persistent + the largest phase."""
    base = sum(persistent.values())
    if acts is None:
        return base, dict(persistent), "initialize (no sequence length: activations not counted)"
    c = _size(dec.compute)
    costs = acts.layer_costs(b)
    s = acts.input_bytes(b)
    n = len(layouts)
    batch = acts.call_arg_bytes(b) + 2 * 8 * b * acts.seq  # layer-call arguments + input ids and labels
    head_grad = acts.head.weight.numel() * c if acts.head_trainable else 0
    emb_grad = acts.embedding.weight.numel() * c if (acts.embedding_trainable and not acts.tied) else 0
    land = 4 if (dec.ga == 1 and dec.grad == "fp32") else c  # the flat gradient in flight on d2h
    # executor._land_local: the flat gradient (compute dtype) converted on the GPU before its D2H when it lands in
    # another dtype: the fp32 home (GA 1), the wire-dtype ring slab (GA > 1: copy_ converts on the source device)
    convert = _size(dec.grad if dec.ga == 1 else dec.wire)
    convert = 0 if convert == c else convert

    def saved(j: int) -> int:  # saved inputs of layers 0..j on the device
        return min(j + 1, 2) * s if offload else (j + 1) * s

    kept = [i for i in range(n - dec.keep, n)]
    kept_graphs = sum(costs[i].graph for i in kept)
    phases: list[tuple[int, dict[str, int], str]] = []
    for j in range(n):
        phases.append((saved(j) + costs[j].forward,
                       {"saved layer inputs": saved(j), "layer forward (no graph)": costs[j].forward},
                       f"the forward of layer {j}"))
    norm = acts.norm_graph(b)
    loss_fwd, _, loss_bwd = acts.loss_bytes(b)
    phases.append((saved(n - 1) + kept_graphs + norm + loss_fwd,
                   {"saved layer inputs": saved(n - 1), "kept layers' graphs": kept_graphs,
                    "final norm graph": norm, f"LM head + loss forward ({acts.loss})": loss_fwd}, "the loss forward"))
    phases.append((saved(n - 1) + kept_graphs + norm + loss_bwd,
                   {"saved layer inputs": saved(n - 1), "kept layers' graphs": kept_graphs,
                    "final norm graph": norm, f"LM head + loss backward ({acts.loss})": loss_bwd}, "the loss backward"))
    for j in range(n - 1, -1, -1):
        inflight = land * layouts[j + 1].n_train if (j + 1 < n and j + 1 >= device_state_layers) else 0
        graphs = sum(costs[i].graph for i in kept if i < j)
        common = {"saved layer inputs": saved(j), "kept layers' graphs": graphs, "LM head gradient": head_grad,
                  "incoming gradient": s, "previous layer's gradient in flight": inflight}
        phases.append((sum(common.values()) + costs[j].backward,
                       {**common, "layer recompute + backward": costs[j].backward}, f"the backward of layer {j}"))
        on_gpu = j < device_state_layers  # a GPU-held layer accumulates in place: no conversion, no D2H
        landing = 0 if on_gpu else convert * layouts[j].n_train
        phases.append((sum(common.values()) + costs[j].after + landing,
                       {**common, "layer gradients + outputs": costs[j].after,
                        "gradient converted for landing": landing},
                       f"the gradient landing of layer {j}"))
    embed = head_grad + emb_grad + s + (s * 4 // c if acts.embedding_trainable else 0)
    phases.append((embed, {"LM head gradient": head_grad, "embedding gradient": emb_grad,
                           "incoming gradient + embedding backward": embed - head_grad - emb_grad},
                   "the embedding backward"))
    top, parts, phase = max(phases, key=lambda p: p[0])
    return base + batch + top, {**persistent, "batch + layer-call arguments": batch, **parts}, phase


def check_capacity(layouts: list[LayerLayout], resident_numels, config: TrainConfig, device, nvme_path=None, *,
                   world: int = 1, seq: int | None = None, activations: ActivationModel | None = None,
                   freed_bytes: int = 0, host_budget=None, gpu_memory: int | None = None,
                   model_name: str = "model", raise_error: bool = True) -> Prediction:
    """Predict host RAM, disk and GPU bytes for these layouts and resident parameters under ``config``; refuse
    (``CapacityError``, the numbers in its message) what clearly does not fit; return the ``Prediction``.

    ``layouts``: every streamed layer's ``LayerLayout`` (``model_map.build_layout``; all layers, whoever owns them);
    ``resident_numels``: per resident parameter (outside the block list; tied ones once) its element count, as an
    int (trainable), an ``(elements, trainable)`` pair or the tensor itself; ``device``: where the engine computes;
    ``nvme_path``: overrides ``offload_optimizer.nvme_path``; ``world``: data-parallel ranks on this host (the
    host total is every rank's); ``seq`` + ``activations`` (``ActivationModel``): the step's GPU working set (without
    them only what initialize allocates is checked); ``freed_bytes``: see ``host_budget_bytes``; ``host_budget``:
    overrides ``megatrain.host_memory_budget`` (GiB or "auto"); ``gpu_memory``: the device's bytes when planning
    for a GPU this machine does not have. Refuses only when host RAM > budget, disk > free space, or the GPU
    bytes at the configured micro-batch > the device's whole memory (``raise_error=False``: never)."""
    device = torch.device(device) if not isinstance(device, torch.device) else device
    dev = "cuda" if device.type == "cuda" else "cpu"
    dec = decide(layouts, config)
    resident = _resident_items(resident_numels)
    n, c = len(layouts), _size(dec.compute)
    owned = [[i % world == r for i in range(n)] for r in range(world)]  # dp.owned_mask of each rank
    notes, problems, advice = list(dec.notes), [], []
    mb, offload = config.micro_batch_size, bool(config.megatrain.offload_activations)
    acts = activations if seq else None

    # --- GPU: what initialize allocates (persistent), then the step (_gpu_at)
    max_numel = max((lay.numel for lay in layouts), default=0)
    slots = min(config.megatrain.num_slots, n)
    persistent = {f"weight slots ({slots} x largest layer, {dec.compute})": slots * max_numel * c}
    if dec.wire != dec.compute:
        persistent[f"{dec.wire} staging of the slots (stream_fp32_master)"] = slots * max_numel * _size(dec.wire)
    persistent["kept layers' weight buffers"] = sum(layouts[i].numel for i in range(n - dec.keep, n)) * c
    persistent["resident parameters (compute copies)"] = sum(m for m, _ in resident) * c
    if dec.resident_on_device:
        persistent["resident fp32 state (GPU-held optimizer)"] = 16 * sum(m for m, t in resident if t)
    persistent["GPU-held layers' master, moments, gradient"] = 0  # set below, once the NVMe split is known
    if dev == "cuda":
        persistent["cuBLAS workspace"] = _cublas_workspace_bytes(device, gpu_memory)
    gpu_min = sum(persistent.values())
    overhead = (CUDA_CONTEXT_BYTES + (NCCL_BYTES if world > 1 else 0)) if dev == "cuda" else 0

    def gpu(b: int) -> tuple[int, dict[str, int], str]:
        return _gpu_at(b, layouts, dec, acts, persistent, offload, dec.n_device_layers)

    def offloaded(b: int) -> int:  # pinned host copies of every layer's saved input during a step
        if not (offload and acts is not None):
            return 0
        one = acts.input_bytes(b)
        return world * n * one  # one buffer of exactly its size per layer (activations.py)

    # --- host RAM: the engine's state (per rank, summed; = host_memory()), beside it what is not in it
    nvme, nvme_path_config, buffer_count = nvme_settings(config)
    nvme_path = nvme_path or nvme_path_config
    staging_count = staging_buffers(buffer_count) if nvme else 0
    masters = nvme and nvme_masters(config)  # offload_param nvme too: the disk layers' fp32 masters leave RAM

    def host_for(disk: frozenset[int], staging: int) -> dict[str, int]:
        parts: dict[str, int] = {}
        for r in range(world):
            for k, v in layer_store_bytes(layouts, owned[r], dec.wire, dec.grad, dec.ga, disk, dec.master,
                                          staging, disk_masters=masters).items():
                parts[f"layers: {k}"] = parts.get(f"layers: {k}", 0) + v
        parts["resident (embeddings, norms, head)"] = world * resident_host_bytes(
            resident, dec.compute, dev, dec.resident_on_device)
        return parts

    optimizer_scratch = sum(optimizer_scratch_bytes(layouts, mask, dec.master) for mask in owned) \
        if config.optimizer is not None else 0
    budget_setting = host_budget if host_budget is not None else config.megatrain.host_memory_budget
    budget = host_budget_bytes(budget_setting, freed_bytes)
    available, total = meminfo()
    budget_source = (f"megatrain.host_memory_budget {budget_setting} GiB" if budget_setting not in (None, "auto")
                     else f"MemAvailable {_fmt(available)}" + (f" + {_fmt(freed_bytes)} freed" if freed_bytes else "")
                     + f" - 5% of MemTotal {_fmt(total)}")

    # --- NVMe tier: the moments (and masters) of the trailing disk layers leave RAM (nvme_split, as
    # engine_nvme_layers)
    moment_bytes = [(12 if masters else 8) * lay.n_train for lay in layouts]
    disk_layers = 0
    if nvme and config.optimizer is not None:
        without = sum(host_for(frozenset(range(n)), 0).values()) + optimizer_scratch + offloaded(mb)
        without += gpu(mb)[0] if (dev == "cpu" and acts is not None) else 0
        disk_layers = nvme_split(without, moment_bytes, staging_count * world, budget,
                                 config.megatrain.nvme_layers, masters)
    disk = frozenset(range(n - disk_layers, n))
    host_parts = host_for(disk, staging_count)
    state = sum(host_parts.values())
    disk_bytes = sum(nvme_layer_bytes(layouts[i].n_train, masters) for i in disk if layouts[i].n_train)
    beside = {"host optimizer scratch (one layer, fp32)": optimizer_scratch}
    dec.n_device_layers = min(dec.n_device_layers, n - disk_layers)  # GPU-held layers lead; NVMe layers trail
    persistent["GPU-held layers' master, moments, gradient"] = sum(  # DeviceOptimizerState.nbytes, rank 0's layers
        4 * (layouts[i].numel if dec.wire == "fp32" else layouts[i].n_train) + 12 * layouts[i].n_train
        for i in range(dec.n_device_layers) if owned[0][i])
    gpu_min = sum(persistent.values())

    def host_need(b: int) -> int:
        need = state + sum(beside.values()) + offloaded(b)
        if dev == "cpu" and acts is not None:  # no GPU: the compute working set is host memory too
            need += gpu(b)[0]
        return need

    host_need_now = host_need(mb)
    host_parts.update(beside)
    host_parts["offloaded layer inputs (pinned, per step)"] = offloaded(mb)
    if dev == "cpu" and acts is not None:
        host_parts["compute working set (the CPU is the device)"] = gpu(mb)[0]

    # --- the device
    if dev == "cuda":
        if gpu_memory is not None:
            gpu_total, gpu_source = int(gpu_memory), f"--gpu-memory {_fmt(int(gpu_memory))}"
        elif torch.cuda.is_available():
            index = device.index if device.index is not None else torch.cuda.current_device()
            gpu_total = torch.cuda.mem_get_info(index)[1]
            gpu_source = f"{torch.cuda.get_device_name(index)} (cuda:{index})"
        else:
            gpu_total, gpu_source = None, "no GPU here (--gpu-memory GiB plans for one)"
    else:
        gpu_total, gpu_source = None, "CPU"
    usable = None if gpu_total is None else (gpu_total - overhead) * (1 - GPU_HEADROOM)
    allocated, gpu_parts, phase = gpu(mb)
    gpu_need = allocated + overhead if acts is not None else None
    if acts is None:
        notes.append("no sequence length: the GPU's activations are not counted")

    # --- the largest micro-batch: the largest b with host(b) <= budget and GPU(b) <= usable. When host RAM does
    # not fit whatever the micro-batch (its state alone), the GPU alone decides (and the plan does not fit anyway)
    host_fixed = state + sum(beside.values())
    host_counts = host_fixed <= budget or dev == "cpu"

    def stops(b: int) -> str | None:
        if host_counts and host_need(b) > budget:
            return "host RAM"
        if usable is not None and gpu(b)[0] > usable:
            return "GPU"
        return None

    max_mb, limit = None, "no sequence length"
    if acts is not None and dev == "cuda" and usable is None and not offload:
        limit = "the GPU's memory is not known: " + gpu_source
    elif acts is not None:
        lo, hi = 0, 1
        while hi <= 1 << 24 and stops(hi) is None:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if stops(mid) is None else (lo, mid)
        max_mb, limit = lo, (stops(hi) or "nothing below 16M sequences")
        if dev == "cuda" and usable is None:
            limit += " (the GPU's memory is not known: " + gpu_source + ")"
        if not host_counts:
            limit += f"; host RAM does not fit at any micro-batch (the state alone needs {_fmt(host_fixed)})"

    # --- verdicts: what does not fit, the binding tier, what to change
    disk_free = disk_free_bytes(nvme_path) if (nvme or nvme_path) else None
    use = {"host RAM": host_need_now / max(budget, 1)}
    if nvme:
        use["disk"] = disk_bytes / disk_free if disk_free else (math.inf if disk_bytes else 0.0)
    if gpu_total is not None:
        use["GPU"] = (gpu_need if gpu_need is not None else gpu_min + overhead) / gpu_total
    binding = max(use, key=use.get)
    refuse = []  # clearly over: CapacityError
    if host_need_now > budget:
        refuse.append(f"host RAM: needs {_fmt(host_need_now)}, budget {_fmt(budget)} ({budget_source})")
        lean = host_need_now - (12 if masters else 8) * sum(layouts[i].n_train for i in range(n) if i not in disk) + \
            world * staging_buffers(buffer_count if nvme else NVME_BUFFER_COUNT) * max(
                (nvme_layer_bytes(lay.n_train, masters) for lay in layouts), default=0) - \
            sum(v for k, v in host_parts.items() if k.endswith("NVMe staging buffers"))
        if not nvme and config.optimizer is not None and lean <= budget:
            advice.append(f"set zero_optimization.offload_optimizer.device=nvme (and nvme_path): the Adam moments of "
                          f"trailing layers go to disk (host RAM with every layer's moments on disk: {_fmt(lean)})")
        elif config.optimizer is not None and lean > budget:
            advice.append(f"even with every layer's Adam moments{' and masters' if masters else ''} on NVMe host RAM "
                          f"needs {_fmt(lean)}: a host with more memory"
                          + ("" if masters or dec.master != "fp32" or dec.compute == "fp32" else
                             ", zero_optimization.offload_param.device=nvme as well (the NVMe layers' fp32 masters "
                             "go to disk too: about 4 host bytes per parameter are left of 16)")
                          + ("" if dec.master != "fp32" or dec.compute != "bf16" else
                             ", bf16.bf16_master_weights_and_grads: true (bf16 masters: 4 host bytes less per "
                             "parameter)")
                          + ", or train adapters (LoRA: the frozen base takes 2 bytes per parameter)")
        elif nvme:
            advice.append(f"megatrain.nvme_layers: \"auto\" (or more than {disk_layers})")
        if offload:
            advice.append("megatrain.offload_activations: false (the saved layer inputs then stay on the GPU)")
        if budget_setting not in (None, "auto"):
            advice.append(f"raise megatrain.host_memory_budget (MemAvailable here: {_fmt(available)})")
    if nvme and disk_free is not None and disk_bytes > disk_free:
        refuse.append(f"disk: needs {_fmt(disk_bytes)} on {nvme_path}, {_fmt(disk_free)} free")
        advice.append("free space on the NVMe path, or set megatrain.nvme_layers lower")
    if nvme and not nvme_path and disk_layers:
        refuse.append("disk: zero_optimization.offload_optimizer.device is nvme but no nvme_path is given")
        advice.append("set zero_optimization.offload_optimizer.nvme_path")
    gpu_over = False
    if gpu_total is not None:
        need_now = gpu_need if gpu_need is not None else gpu_min + overhead
        if need_now > gpu_total:
            gpu_over = True
            refuse.append(f"GPU: needs {_fmt(need_now)} at micro-batch {mb}"
                          f"{'' if acts is not None else ' before any activation'}, the device has {_fmt(gpu_total)}")
        elif gpu_need is not None and allocated > usable:
            problems.append(f"GPU: needs {_fmt(gpu_need)} at micro-batch {mb}: less than {GPU_HEADROOM:.0%} of the "
                            f"device's {_fmt(gpu_total)} stays free for fragmentation")
            gpu_over = True
    if gpu_over and acts is not None:
        if max_mb:
            advice.append(f"lower the micro-batch to {max_mb} (train_micro_batch_size_per_gpu; raise "
                          "gradient_accumulation_steps to keep the batch)")
        if not offload:
            advice.append(f"megatrain.offload_activations: true (the saved layer inputs, "
                          f"{_fmt(n * acts.input_bytes(mb))} per GPU, move to pinned host memory)")
        if dec.keep:
            advice.append("megatrain.keep_activations: 0")
        if dec.n_device_layers:
            advice.append("megatrain.gpu_optimizer_layers: 0")
    elif gpu_over:
        advice.append("megatrain.num_slots: 2, gpu_optimizer_layers: 0, keep_activations: 0; or a larger GPU")
    if dev == "cuda" and gpu_total is None:
        notes.append("no GPU here: GPU bytes are predicted, not checked (--gpu-memory GiB plans for one)")
    params = sum(lay.numel for lay in layouts) + sum(m for m, _ in resident)
    trainable = sum(lay.n_train for lay in layouts) + sum(m for m, t in resident if t)
    pred = Prediction(
        model=model_name, n_layers=n, params=params, trainable=trainable, compute=dec.compute, wire=dec.wire,
        grad=dec.grad, ga=dec.ga, micro_batch=mb, seq=seq if acts is not None else None, world=world, device=dev,
        host_parts=host_parts, host_state_bytes=state, host_need_bytes=host_need_now, host_budget_bytes=budget,
        host_budget_source=budget_source, host_available_bytes=available, host_total_bytes=total, nvme=nvme,
        nvme_path=nvme_path, disk_layers=disk_layers, nvme_masters=bool(masters), disk_bytes=disk_bytes,
        disk_free_bytes=disk_free,
        gpu_parts=gpu_parts if dev == "cuda" else {}, gpu_phase=phase,
        gpu_allocated_bytes=allocated if acts is not None else None, gpu_min_bytes=gpu_min,
        gpu_overhead_bytes=overhead, gpu_total_bytes=gpu_total, gpu_source=gpu_source, max_micro_batch=max_mb,
        max_micro_batch_limit=limit, binding=binding, fits=not refuse, problems=refuse + problems, advice=advice,
        notes=notes)
    if raise_error and refuse:
        raise CapacityError(f"megatrain_ds: this run does not fit (binding limit: {binding}): " + "; ".join(refuse)
                            + (". Change: " + "; ".join(advice) if advice else "") + "\n" + pred.table(), pred)
    return pred


# ------------------------------------------------------------------------------------------- from a model
def _trainable(model: nn.Module, config: TrainConfig, model_parameters=None) -> dict[int, int]:
    """id -> optimizer group, as the engine's ``_param_groups`` makes them (none without an optimizer)."""
    if config.optimizer is None:
        return {}
    items = list(model.parameters() if model_parameters is None else model_parameters)
    if not items or not isinstance(items[0], dict):
        items = [{"params": items}]
    return {id(p): g for g, item in enumerate(items) for p in item["params"] if p.requires_grad}


def _loss_kind(model: nn.Module, config: TrainConfig, gpu: bool) -> tuple[str, tuple | None]:
    """How the engine computes the loss of a ``labels=`` forward, and (LM head, input embedding)."""
    from .engine import _fused_loss_parts

    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    head = base.get_output_embeddings() if callable(getattr(base, "get_output_embeddings", None)) else None
    embedding = base.get_input_embeddings() if callable(getattr(base, "get_input_embeddings", None)) else None
    name = type(base).__name__
    if not isinstance(head, nn.Linear) or not (name.endswith("ForCausalLM") or name.endswith("LMHeadModel")):
        return "none", None
    fused = config.megatrain.fused_loss and _fused_loss_parts(model) is not None and \
        not getattr(getattr(base, "config", None), "output_router_logits", False)
    if not fused:
        return "model's own", (head, embedding)
    if gpu and config.megatrain.use_liger and _liger_installed():
        return "liger", (head, embedding)
    return "torch", (head, embedding)


def _liger_kernels_apply(model: nn.Module, config: TrainConfig, gpu: bool) -> bool:
    """engine._apply_liger_kernels' decision, on this machine."""
    setting = config.megatrain.liger_kernels
    if setting == "auto" and config.compute_dtype == "fp32":
        return False
    if not gpu or setting is False or not _liger_installed():
        return False
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except Exception:
        return False
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    return getattr(getattr(base, "config", None), "model_type", None) in MODEL_TYPE_TO_APPLY_LIGER_FN


def plan_model(model: nn.Module, config: TrainConfig, *, seq: int | None = None, device="cuda", world: int = 1,
               nvme_path: str | None = None, host_budget=None, gpu_memory: int | None = None, model_parameters=None,
               name: str | None = None, raise_error: bool = False) -> Prediction:
    """The plan for ``model`` (built on the meta device, or a real model: it is not changed, its weights are not
    copied) trained with ``config`` and ``model_parameters`` (as given to initialize): layouts and resident
    parameters exactly as the engine makes them; with ``seq``, the GPU working set measured on a meta copy."""
    device = torch.device(device)
    gpu = device.type == "cuda"
    group_of = _trainable(model, config, model_parameters)
    block_name, layers = find_block_list(model)
    shared_ids = shared_parameter_ids(model, layers)
    layouts = [build_layout(i, layer, group_of, shared_ids) for i, layer in enumerate(layers)]
    layer_ids = {id(p) for layer in layers for p in layer.parameters()} - shared_ids
    resident = [(p.numel(), id(p) in group_of) for p in model.parameters() if id(p) not in layer_ids]
    acts = None
    notes = []
    if seq:
        loss, parts = _loss_kind(model, config, gpu)
        liger = _liger_kernels_apply(model, config, gpu)
        twin = _meta_twin(model)
        twin_parts = None
        if parts is not None:  # the same modules in the twin, by name
            names = {id(m): n for n, m in model.named_modules()}
            twin_parts = tuple(twin.get_submodule(names[id(m)]) if m is not None and id(m) in names else None
                               for m in parts)
        twin_ids = {id(tp): g for (p, g), tp in zip(
            ((p, group_of.get(id(p))) for p in model.parameters()), twin.parameters()) if g is not None}
        try:
            acts = ActivationModel(twin, block_name, layouts, seq, config.compute_dtype, gpu=gpu,
                                   liger_kernels=liger, loss=loss, fused_parts=twin_parts,
                                   trainable_ids=set(twin_ids),
                                   tiled_mlp=getattr(config.megatrain, "tiled_mlp", False))
            acts.chunk_rows = config.megatrain.loss_chunk_rows
        except Exception as exc:  # a model the meta device cannot run: the host plan still stands
            notes.append(f"the GPU working set was not predicted: running the model on the meta device failed "
                         f"({type(exc).__name__}: {str(exc)[:200]})")
            acts = None
        if acts is not None:
            kernels = "liger-kernel's RMSNorm/SwiGLU" if liger else "the model's own norm/MLP"
            notes.append(f"kernels planned: {'flash' if acts.flash else 'math'} attention, {kernels}, loss: {loss}")
    pred = check_capacity(layouts, resident, config, device, nvme_path, world=world, seq=seq if acts else None,
                          activations=acts, host_budget=host_budget, gpu_memory=gpu_memory,
                          model_name=name or type(model).__name__, raise_error=raise_error)
    pred.notes.extend(notes)
    return pred


# The command line lives in plan_cli.py (it imports this module); its names, looked up here on first use, keep
# ``plan.main``, ``from megatrain_ds.plan import meta_model`` and the like working
_CLI_NAMES = frozenset({"load_model_config", "meta_model", "load_train_config", "default_ds_config", "add_arguments",
                        "run", "main"})


def __getattr__(name: str):
    if name in _CLI_NAMES:
        from . import plan_cli
        return getattr(plan_cli, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    import sys

    from megatrain_ds.plan_cli import main as _main
    sys.exit(_main())
