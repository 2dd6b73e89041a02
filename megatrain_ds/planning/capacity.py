"""The capacity check: host RAM, disk and GPU bytes of a run, predicted before anything is built,
and refused when they clearly do not fit.

``check_capacity`` sums, for a run's ``Decisions`` (decisions.py), what the engine will hold on
every tier, by the same rules as the code that allocates it (host_bytes.py for the host's buffers,
plan_gpu.py's ``ActivationModel`` for the step's GPU working set), and returns a ``Prediction`` (the
table the CLI and the engine print), or raises ``CapacityError`` with the numbers. The engine calls
it with its own decisions before it builds a buffer (engine_build.py); ``megatrain-ds plan`` calls
it through plan.py's ``plan_model``, which resolves the decisions for the whole host. This module
owns the sums, the verdicts (which tier binds, what to change) and the largest micro-batch; it
decides nothing about the run itself.

The model of memory
-------------------

**Host RAM** (persistent; ``host_state_bytes`` equals ``engine.host_memory()["total_bytes"]`` summed
over ranks, to the byte: tests/unit/test_plan.py, tests/integration/test_dp.py with 2 ranks):

- ``HostLayerStore`` (host_state.py), for the streamed layers a rank owns (data parallel: layer i on
  position i % N of the host's ranks, dp.py's ``Topology``, so the layers are held once per host):
  the master (fp32; bf16 with ``bf16_master_weights_and_grads``), whole layers when it is the wire
  copy, else the trainable elements only (frozen weights live in the wire copy only); exp_avg and
  exp_avg_sq (fp32, trainable); the wire copy (all elements, in the wire dtype; none when the wire
  is the master); the gradient home (trainable elements, in the landing dtype with GA 1, fp32 with
  GA > 1); with GA > 1, a landing ring of 4 slabs of the largest layer's trainable region (wire
  dtype) plus an fp32 scratch.
- The NVMe tier (``zero_optimization.offload_optimizer.device: nvme``, nvme.py): the Adam moments of
  a suffix of the streamed layers leave RAM for the disk (host_bytes.py's ``nvme_split`` picks how
  many; decisions.py's ``resolve`` applies it, for the engine and the planner alike); RAM gains
  ``max(2, buffer_count)`` staging buffers of the largest disk layer's region.
- ``ResidentParams`` (resident.py), each trained one's state on one rank of the host
  (``dp.resident_positions``; the other ranks keep its device copy only): per trainable element fp32
  master, exp_avg, exp_avg_sq and gradient (16 bytes) plus a pinned compute-dtype wire copy and
  landing buffer (2 x 2 bytes in bf16); nothing on the host when that state is on the GPU
  (``gpu_optimizer_layers`` > 0 at initialize), and nothing for a frozen one (its only copy is on
  the device). On a CPU "device" the device copies are host memory too.
- Beside the state (not in ``host_memory()``): the host optimizer's fp32 scratch (one layer; two in
  bf16-master mode), and, with ``offload_activations``, every layer's saved input in pinned host
  memory (a buffer of exactly its size each, activations.py), per step.

**Disk**: per disk layer ``2 * align(4 * n_train, 4096)`` (exp_avg and exp_avg_sq, page aligned);
``3 *`` with masters on NVMe (``offload_param.device: nvme``), whose masters then leave RAM as well.

**GPU** (per rank; ``gpu_allocated_bytes`` is what ``torch.cuda.max_memory_allocated`` reports for a
step):

- persistent: ``num_slots`` weight slots of the largest layer in the compute dtype, each with an
  fp32 staging buffer when the fp32 master streams (``stream_fp32_master``); the kept layers' own
  weight buffers; the resident parameters' compute-dtype copies (and their fp32 state, with GPU-held
  optimizer state); the GPU-held layers' state (``gpu_optimizer_layers`` > 0: 4 bytes per master
  element + 12 per trainable one); the cuBLAS workspace; the batch and the layer-call arguments
  (rotary tables).
- per phase of the step, the largest of: the forward of layer j (inputs saved so far + its no-grad
  forward); the loss forward and backward (every saved input + the final norm's graph + the LM head
  and cross-entropy); the backward of layer j (inputs of layers <= j + the LM head's gradient + the
  incoming gradient + the previous layer's flat gradient still on its way to the host + layer j's
  recompute-and-gradient working set); the landing of layer j's gradient (its conversion to the
  landing dtype); the embedding's backward.
- The per-layer working sets, the final norm's graph and the torch-chunked or model's own loss are
  *measured* (plan_gpu.py): the layer runs on the meta device under a dispatch mode that tracks
  every tensor storage an op creates and frees (``_LiveBytes``), as the executor runs it (its
  template, bound to a flat slot, tiled by tiling.py when ``tiled_mlp`` says so). The live total at
  each moment is linear in the micro-batch, so two runs (micro-batch 1 and 2) give the peak at any
  micro-batch. Emulated, because they differ on a GPU: attention with no mask runs as flash
  attention (output + fp32 log-sum-exp saved; the backward's fp32 dq accumulator; fp32 with grouped
  KV heads falls back to the math kernel, measured as such); when liger-kernel applies (CUDA,
  installed, a model type it knows), its RMSNorm and SwiGLU (what they save, in-place backward);
  autograd adds a second gradient into the first in place on real devices (not on meta). liger's
  fused linear cross-entropy is computed from its chunking rule (transient logits of about tokens x
  hidden; fp32 head-gradient accumulator).
- Not allocated by torch, so added to what must fit, not to ``gpu_allocated_bytes``: the CUDA
  context and kernels (``CUDA_CONTEXT_BYTES``), NCCL's buffers with several ranks. The largest
  micro-batch keeps ``GPU_HEADROOM`` of the rest free for the caching allocator's fragmentation.
- Not predicted: what ``"auto"`` places after the second step (kept layers, GPU-held optimizer
  state) in the memory that step left free; the inference cache (no-grad forwards); a host that
  launches kernels several layers ahead of the GPU can hold more than one flat gradient in flight
  (one is counted).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field

import torch

from .settings import TrainConfig
from .decisions import Decisions, HostShare, resolve
from ..parallel import Topology, resident_positions
from ..host import memlock_limit, pinning_limits
from .host_bytes import (
    NVME_BUFFER_COUNT,
    GiB,
    MiB,
    HostBudget,
    resident_items,
    disk_free_bytes,
    layer_store_bytes,
    meminfo,
    nvme_layer_bytes,
    nvme_settings,
    optimizer_scratch_bytes,
    resident_host_bytes,
    staging_buffers,
)

# check_capacity's argument host_budget is the setting
from .host_bytes import host_budget as measure_budget
from ..model import LayerLayout
from .plan_gpu import ActivationModel, dtype_size

# CUDA context, loaded kernels, cuDNN/cuBLAS handles (an estimate; not torch's)
CUDA_CONTEXT_BYTES = 768 * MiB
NCCL_BYTES = 512 * MiB  # NCCL's own buffers per rank with several ranks (an estimate; not torch's)
# torch's cuBLAS workspace on the compute stream, Hopper (torch's allocator)
CUBLAS_WORKSPACE_BYTES = 32 * MiB
CUBLAS_WORKSPACE_BYTES_PRE_HOPPER = 4096 * 1024 * 2 + 16 * 1024 * 8  # torch's default before sm90
GPU_HEADROOM = 0.05  # of the memory left after the context: the caching allocator's fragmentation


class CapacityError(RuntimeError):
    """The predicted memory clearly exceeds what this machine has; the message gives the numbers
    (needed vs available per tier), which limit binds and what to change. ``prediction`` holds the
    whole plan."""

    def __init__(self, message: str, prediction: "Prediction") -> None:
        super().__init__(message)
        self.prediction = prediction


# ----------------------------------------------------------------------------------------- the plan
@dataclass
class Prediction:
    """The plan: per tier, what is needed and what this machine has. ``table()`` is what the CLI and
    the engine print; ``to_dict()`` what ``--json`` prints."""

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
    # engine state parts (summed over ranks), then staging and what is beside it
    host_parts: dict[str, int]
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
    # torch.cuda.max_memory_allocated after a step (None: no sequence length)
    gpu_allocated_bytes: int | None
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
    decisions: Decisions | None = None  # what was counted (decisions.resolve); not in to_dict()

    @property
    def gpu_need_bytes(self) -> int | None:
        """What must fit in the device's memory at the configured micro-batch (context included)."""
        return (
            None
            if self.gpu_allocated_bytes is None
            else self.gpu_allocated_bytes + self.gpu_overhead_bytes
        )

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("decisions")
        out["gpu_need_bytes"] = self.gpu_need_bytes
        return out

    def table(self) -> str:
        lines = [
            f"megatrain-ds plan: {self.model} ({self.n_layers} streamed layers, "
            f"{_count(self.params)} parameters, "
            f"{_count(self.trainable)} trainable; {self.compute} compute, {self.wire} wire, "
            f"{self.grad} "
            f"gradients, GA {self.ga}; {self.world} {'GPU' if self.device == 'cuda' else 'process'}"
            f"{'s' if self.world > 1 else ''})"
        ]
        if self.seq:
            lines.append(
                f"micro-batch {self.micro_batch} x seq {self.seq} = {self.micro_batch * self.seq:,}"
                " tokens "
                f"per {'GPU' if self.device == 'cuda' else 'process'}"
            )
        lines.append("")
        lines.append(f"{'tier':<10}{'needed':>14}{'available':>14}  ")
        host_have = f"{_fmt(self.host_budget_bytes)}"
        lines.append(
            f"{'host RAM':<10}{_fmt(self.host_need_bytes):>14}{host_have:>14}  "
            f"budget: {self.host_budget_source}"
        )
        for name, n in self.host_parts.items():
            if n:
                lines.append(f"  {name:<44}{_fmt(n):>12}")
        if self.nvme:
            free = "?" if self.disk_free_bytes is None else _fmt(self.disk_free_bytes)
            what = "fp32 masters and Adam moments" if self.nvme_masters else "Adam moments"
            lines.append(
                f"{'disk':<10}{_fmt(self.disk_bytes):>14}{free:>14}  {what} of the last "
                f"{self.disk_layers} layer(s) on {self.nvme_path or '(no nvme_path)'}"
            )
        else:
            free = "" if self.disk_free_bytes is None else f"{_fmt(self.disk_free_bytes)}"
            lines.append(
                f"{'disk':<10}{_fmt(0):>14}{free:>14}  no NVMe tier "
                "(zero_optimization.offload_optimizer.device is not nvme)"
            )
        if self.device == "cuda":
            need = "?" if self.gpu_need_bytes is None else _fmt(self.gpu_need_bytes)
            have = _fmt(self.gpu_total_bytes) if self.gpu_total_bytes else "-"
            lines.append(
                f"{'GPU':<10}{need:>14}{have:>14}  {self.gpu_source}; per GPU, peak in "
                f"{self.gpu_phase}"
            )
            for name, n in self.gpu_parts.items():
                if n:
                    lines.append(f"  {name:<44}{_fmt(n):>12}")
        else:
            lines.append(
                f"{'GPU':<10}{'-':>14}{'-':>14}  the engine computes on the CPU: its working set "
                "is counted in host RAM"
            )
        lines.append("")
        if self.max_micro_batch is not None:
            lines.append(
                f"largest micro-batch per {'GPU' if self.device == 'cuda' else 'process'} at seq "
                f"{self.seq}: {self.max_micro_batch} (limited by {self.max_micro_batch_limit})"
            )
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
    """The cuBLAS workspace torch allocates per (handle, stream) through its caching allocator: only
    the compute stream runs GEMMs here. ``CUBLAS_WORKSPACE_CONFIG`` (":SIZE_KiB:COUNT" ...) when
    set; else torch's default for the device here (planning for another GPU: Hopper's)."""
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if config:
        try:
            parts = [p for p in config.split(":") if p]
            return sum(
                int(parts[k]) * 1024 * int(parts[k + 1]) for k in range(0, len(parts) - 1, 2)
            )
        except ValueError:
            pass
    if gpu_memory is None and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        if torch.cuda.get_device_capability(index)[0] < 9:
            return CUBLAS_WORKSPACE_BYTES_PRE_HOPPER
    return CUBLAS_WORKSPACE_BYTES


def _gpu_at(
    b: int,
    layouts,
    dec: Decisions,
    acts: ActivationModel | None,
    persistent: dict[str, int],
    offload: bool,
    device_state_layers: int,
) -> tuple[int, dict[str, int], str]:
    """(peak allocated bytes, parts at the peak, the phase) for micro-batch ``b``: persistent + the
    largest phase."""
    base = sum(persistent.values())
    if acts is None:
        return base, dict(persistent), "initialize (no sequence length: activations not counted)"
    c = dtype_size(dec.compute)
    costs = acts.layer_costs(b)
    s = acts.input_bytes(b)
    n = len(layouts)
    # layer-call arguments + input ids and labels
    batch = acts.call_arg_bytes(b) + 2 * 8 * b * acts.seq
    head_grad = acts.head.weight.numel() * c if acts.head_trainable else 0
    emb_grad = (
        acts.embedding.weight.numel() * c if (acts.embedding_trainable and not acts.tied) else 0
    )
    land = 4 if (dec.ga == 1 and dec.grad == "fp32") else c  # the flat gradient in flight on d2h
    # executor._land_local: the flat gradient (compute dtype) converted on the GPU before its D2H
    # when it lands in another dtype: the fp32 home (GA 1), the wire-dtype ring slab (GA > 1: copy_
    # converts on the source device)
    convert = dtype_size(dec.grad if dec.ga == 1 else dec.wire)
    convert = 0 if convert == c else convert

    def saved(j: int) -> int:  # saved inputs of layers 0..j on the device
        return min(j + 1, 2) * s if offload else (j + 1) * s

    kept = [i for i in range(n - dec.keep, n)]
    kept_graphs = sum(costs[i].graph for i in kept)
    phases: list[tuple[int, dict[str, int], str]] = []
    for j in range(n):
        phases.append(
            (
                saved(j) + costs[j].forward,
                {"saved layer inputs": saved(j), "layer forward (no graph)": costs[j].forward},
                f"the forward of layer {j}",
            )
        )
    norm = acts.norm_graph(b)
    loss_fwd, _, loss_bwd = acts.loss_bytes(b)
    phases.append(
        (
            saved(n - 1) + kept_graphs + norm + loss_fwd,
            {
                "saved layer inputs": saved(n - 1),
                "kept layers' graphs": kept_graphs,
                "final norm graph": norm,
                f"LM head + loss forward ({acts.loss})": loss_fwd,
            },
            "the loss forward",
        )
    )
    phases.append(
        (
            saved(n - 1) + kept_graphs + norm + loss_bwd,
            {
                "saved layer inputs": saved(n - 1),
                "kept layers' graphs": kept_graphs,
                "final norm graph": norm,
                f"LM head + loss backward ({acts.loss})": loss_bwd,
            },
            "the loss backward",
        )
    )
    for j in range(n - 1, -1, -1):
        inflight = (
            land * layouts[j + 1].n_train if (j + 1 < n and j + 1 >= device_state_layers) else 0
        )
        graphs = sum(costs[i].graph for i in kept if i < j)
        common = {
            "saved layer inputs": saved(j),
            "kept layers' graphs": graphs,
            "LM head gradient": head_grad,
            "incoming gradient": s,
            "previous layer's gradient in flight": inflight,
        }
        phases.append(
            (
                sum(common.values()) + costs[j].backward,
                {**common, "layer recompute + backward": costs[j].backward},
                f"the backward of layer {j}",
            )
        )
        # a GPU-held layer accumulates in place: no conversion, no D2H
        on_gpu = j < device_state_layers
        landing = 0 if on_gpu else convert * layouts[j].n_train
        phases.append(
            (
                sum(common.values()) + costs[j].after + landing,
                {
                    **common,
                    "layer gradients + outputs": costs[j].after,
                    "gradient converted for landing": landing,
                },
                f"the gradient landing of layer {j}",
            )
        )
    embed = head_grad + emb_grad + s + (s * 4 // c if acts.embedding_trainable else 0)
    phases.append(
        (
            embed,
            {
                "LM head gradient": head_grad,
                "embedding gradient": emb_grad,
                "incoming gradient + embedding backward": embed - head_grad - emb_grad,
            },
            "the embedding backward",
        )
    )
    top, parts, phase = max(phases, key=lambda p: p[0])
    return base + batch + top, {**persistent, "batch + layer-call arguments": batch, **parts}, phase


def check_capacity(
    layouts: list[LayerLayout],
    resident_numels,
    config: TrainConfig,
    device,
    nvme_path=None,
    *,
    world: int = 1,
    seq: int | None = None,
    activations: ActivationModel | None = None,
    freed_bytes: int = 0,
    host_budget=None,
    gpu_memory: int | None = None,
    model_name: str = "model",
    raise_error: bool = True,
    decisions: Decisions | None = None,
    owned=None,
    resident_owned=None,
) -> Prediction:
    """Predict host RAM, disk and GPU bytes for these layouts and resident parameters under
    ``config``; refuse (``CapacityError``, the numbers in its message) what clearly does not fit;
    return the ``Prediction``.

    ``layouts``: every streamed layer's ``LayerLayout`` (``model_map.build_layout``; all layers,
    whoever owns them); ``resident_numels``: per resident parameter (outside the block list; tied
    ones once) its element count, as an int (trainable), an ``(elements, trainable)`` pair or the
    tensor itself; ``device``: where the engine computes; ``nvme_path``: overrides
    ``offload_optimizer.nvme_path``; ``world``: data-parallel ranks on this host (the host total is
    every rank's); ``owned`` / ``resident_owned``: what each of them holds (one mask of the layers /
    of the resident parameters per rank; default: the ``world`` ranks are one shard, dp.py's
    ``Topology``); ``seq`` + ``activations`` (``ActivationModel``): the step's GPU working set
    (without them only what initialize allocates is checked); ``freed_bytes``: see
    ``host_budget_bytes``; ``host_budget``: overrides ``megatrain.host_memory_budget`` (GiB or
    "auto"); ``gpu_memory``: the device's bytes when planning for a GPU this machine does not have;
    ``decisions``: the run's (the engine passes its own), else resolved here for the whole host
    (decisions.resolve, its NVMe split fitting every rank's state and the step's host memory in the
    budget). Refuses only when host RAM > budget, disk > free space, or the GPU bytes at the
    configured micro-batch > the device's whole memory (``raise_error=False``: never)."""
    device = torch.device(device) if not isinstance(device, torch.device) else device
    resident = resident_items(resident_numels)
    acts = activations if seq else None
    budget_setting = host_budget if host_budget is not None else config.megatrain.host_memory_budget
    # the binding limit and its bytes (host_bytes.py)
    measured = measure_budget(budget_setting, freed_bytes)
    budget = measured.bytes

    if owned is None:  # the host's ranks are one shard (dp.py): layer i on rank i % world
        topo = Topology.uniform(1, world)
        owned = tuple(tuple(topo.owned_mask(r, len(layouts))) for r in range(world))
    if resident_owned is None:
        positions = resident_positions(resident, len(owned))
        resident_owned = tuple(
            tuple(p is None or p == r for p in positions) for r in range(len(owned))
        )

    def tally(dec: Decisions) -> _Counting:
        return _Counting(
            layouts, resident, config, dec, device, gpu_memory, world, acts, owned, resident_owned
        )

    # what the budget holds beside the state: the step's host memory
    def beside(before_split: Decisions) -> int:
        counted = tally(before_split)
        return counted.offloaded(counted.mb) + counted.compute_on_host(counted.mb)

    if decisions is None:  # every rank of the host shares the budget
        decisions = resolve(
            config,
            layouts,
            "cuda" if device.type == "cuda" else "cpu",
            HostShare(tuple(resident), tuple(owned), budget, beside, tuple(resident_owned)),
        )
    t = tally(decisions)
    host = t.count_host(nvme_path, measured, budget_setting)
    gpu = t.count_gpu(gpu_memory)
    largest = t.largest_micro_batch(host, gpu)
    verdict = t.verdicts(host, gpu, largest[0])
    pred = t.prediction(model_name, seq, host, gpu, largest, verdict)
    refuse, advice = verdict.refuse, verdict.advice
    if raise_error and refuse:
        raise CapacityError(
            f"megatrain_ds: this run does not fit (binding limit: {pred.binding}): "
            + "; ".join(refuse)
            + (". Change: " + "; ".join(advice) if advice else "")
            + "\n"
            + pred.table(),
            pred,
        )
    return pred


@dataclass(frozen=True)
class HostCount:
    """Host RAM and the NVMe tier's disk of one plan (``_Counting.count_host``)."""

    nvme: bool  # the NVMe tier is configured
    nvme_path: str | None
    buffer_count: int  # the tier's staging buffers (aio.buffer_count)
    budget: int  # bytes the host state and what is beside it may take
    budget_setting: object  # megatrain.host_memory_budget as given (GiB, "auto" or None)
    budget_source: str  # where the budget comes from, in words
    available: int | None  # MemAvailable, MemTotal
    total: int | None
    scratch: int  # the host optimizer's scratch (every rank's)
    disk: frozenset  # the layers on the NVMe tier
    parts: dict  # the host bytes by part, as the prediction's table shows them
    state: int  # the engine's host state (= host_memory())
    disk_bytes: int  # the NVMe tier's file(s)
    need_now: int  # host bytes at the configured micro-batch
    disk_free: int | None  # free bytes on the NVMe path (None: no path)


@dataclass(frozen=True)
class GpuCount:
    """The device of one plan (``_Counting.count_gpu``)."""

    total: int | None  # the device's bytes (None: not known, or a CPU run)
    source: str  # where ``total`` comes from
    # what allocations may take: less the context and the fragmentation headroom
    usable: float | None
    allocated: int  # the step's peak at the configured micro-batch
    parts: dict  # its parts
    phase: str  # the phase of the step the peak is in
    # allocated + context (None: no sequence length, the activations are not counted)
    need: int | None
    notes: tuple = ()


@dataclass(frozen=True)
class Verdicts:
    """What clearly does not fit (CapacityError), other problems, what to change, and the binding
    tier."""

    refuse: list
    problems: list
    advice: list
    binding: str
    notes: tuple = ()


class _Counting:
    """The counting of one plan, for decisions ``dec``: what the GPU holds (persistent, then per
    micro-batch: ``gpu``), what the host holds (the engine's state for a set of disk layers:
    ``host_for``; beside it). Its fields are the plan's inputs, set in ``__init__``; each counting
    step returns its numbers as a value (``HostCount``, ``GpuCount``, the largest micro-batch,
    ``Verdicts``) that the next ones and ``prediction`` are given."""

    def __init__(
        self,
        layouts: list[LayerLayout],
        resident: list[tuple[int, bool]],
        config: TrainConfig,
        dec: Decisions,
        device: torch.device,
        gpu_memory: int | None,
        world: int,
        acts: ActivationModel | None,
        owned,
        resident_owned,
    ) -> None:
        self.layouts, self.resident, self.config, self.dec = layouts, resident, config, dec
        self.world, self.acts, self.n, self.device = world, acts, len(layouts), device
        self.dev = "cuda" if device.type == "cuda" else "cpu"
        # the layers each rank of the host holds (dp.owned_mask)
        self.owned = [list(mask) for mask in owned]
        # the resident state each holds
        self.resident_owned = [list(mask) for mask in resident_owned]
        self.mb, self.offload = config.micro_batch_size, bool(config.megatrain.offload_activations)
        self.persistent = self._persistent(device, gpu_memory)
        self.gpu_min = sum(self.persistent.values())
        self.overhead = (
            (CUDA_CONTEXT_BYTES + (NCCL_BYTES if world > 1 else 0)) if self.dev == "cuda" else 0
        )

    def _persistent(self, device: torch.device, gpu_memory: int | None) -> dict[str, int]:
        """GPU bytes initialize allocates: weight slots (and their fp32 staging), kept layers'
        buffers, resident copies (and their state when GPU-held), the GPU-held layers' state, the
        cuBLAS workspace."""
        dec, layouts, n, c = self.dec, self.layouts, self.n, dtype_size(self.dec.compute)
        max_numel = max((lay.numel for lay in layouts), default=0)
        slots = min(self.config.megatrain.num_slots, n)
        persistent = {
            f"weight slots ({slots} x largest layer, {dec.compute})": slots * max_numel * c
        }
        if dec.wire != dec.compute:
            persistent[f"{dec.wire} staging of the slots (stream_fp32_master)"] = (
                slots * max_numel * dtype_size(dec.wire)
            )
        persistent["kept layers' weight buffers"] = (
            sum(layouts[i].numel for i in range(n - dec.keep, n)) * c
        )
        persistent["resident parameters (compute copies)"] = sum(m for m, _ in self.resident) * c
        if dec.resident_on_device:  # rank 0's (data parallel: the resident parameters it holds)
            persistent["resident fp32 state (GPU-held optimizer)"] = 16 * sum(
                m for (m, t), mine in zip(self.resident, self.resident_owned[0]) if t and mine
            )
        # DeviceOptimizerState.nbytes, rank 0's
        persistent["GPU-held layers' master, moments, gradient"] = sum(
            4 * (layouts[i].numel if dec.wire == "fp32" else layouts[i].n_train)
            + 12 * layouts[i].n_train
            for i in range(dec.n_device_layers)
            if self.owned[0][i]
        )
        # grad_hold.py: every streamed layer's gradient rank 0 holds, until its update fetches it
        if dec.grad_hold:
            persistent[f"{dec.grad} gradients held until the norm (gradient_hold)"] = dtype_size(
                dec.grad
            ) * sum(lay.n_train for lay, mine in zip(layouts, self.owned[0]) if mine)
        if self.dev == "cuda":
            persistent["cuBLAS workspace"] = _cublas_workspace_bytes(device, gpu_memory)
        return persistent

    def gpu(self, b: int) -> tuple[int, dict[str, int], str]:
        return _gpu_at(
            b,
            self.layouts,
            self.dec,
            self.acts,
            self.persistent,
            self.offload,
            self.dec.n_device_layers,
        )

    def offloaded(self, b: int) -> int:
        """Pinned host copies of every layer's saved input during a step: one buffer of exactly its
        size per layer (activations.py)."""
        if not (self.offload and self.acts is not None):
            return 0
        return self.world * self.n * self.acts.input_bytes(b)

    def compute_on_host(self, b: int) -> int:
        """No GPU: the compute working set is host memory too."""
        return self.gpu(b)[0] if (self.dev == "cpu" and self.acts is not None) else 0

    def host_for(self, disk: frozenset[int], staging: int) -> dict[str, int]:
        """The engine's host state (per rank, summed; = host_memory()) with the ``disk`` layers on
        NVMe."""
        dec, parts = self.dec, {}
        for r in range(self.world):
            for k, v in layer_store_bytes(
                self.layouts,
                self.owned[r],
                dec.wire,
                dec.grad,
                dec.ga,
                disk,
                dec.master,
                staging,
                disk_masters=dec.nvme_masters,
                moments=dec.moments,
                hold=dec.grad_hold,
            ).items():
                parts[f"layers: {k}"] = parts.get(f"layers: {k}", 0) + v
        # each held by one rank (dp.py)
        parts["resident (embeddings, norms, head)"] = sum(
            resident_host_bytes(
                [item for item, mine in zip(self.resident, mask) if mine],
                dec.compute,
                self.dev,
                dec.resident_on_device,
            )
            for mask in self.resident_owned
        )
        return parts

    def host_need(self, state: int, scratch: int, b: int) -> int:
        return state + scratch + self.offloaded(b) + self.compute_on_host(b)

    def count_host(self, nvme_path: str | None, measured: HostBudget, budget_setting) -> HostCount:
        """Host RAM (the state, beside it what is not in it) and the NVMe tier's disk, against the
        budget."""
        dec, layouts, n = self.dec, self.layouts, self.n
        nvme, nvme_path_config, buffer_count = nvme_settings(self.config)
        nvme_path = nvme_path or nvme_path_config
        available, total = meminfo()
        budget, budget_source = measured.bytes, measured.source
        scratch = (
            sum(optimizer_scratch_bytes(layouts, mask, dec.master) for mask in self.owned)
            if self.config.optimizer is not None
            else 0
        )
        disk = frozenset(range(n - dec.disk_layers, n))
        parts = self.host_for(disk, staging_buffers(buffer_count) if nvme else 0)
        state = sum(parts.values())
        disk_bytes = sum(
            nvme_layer_bytes(layouts[i].n_train, dec.nvme_masters)
            for i in disk
            if layouts[i].n_train
        )
        need_now = self.host_need(state, scratch, self.mb)
        parts["host optimizer scratch (one layer, fp32)"] = scratch
        parts["offloaded layer inputs (pinned, per step)"] = self.offloaded(self.mb)
        if self.dev == "cpu" and self.acts is not None:
            parts["compute working set (the CPU is the device)"] = self.gpu(self.mb)[0]
        disk_free = disk_free_bytes(nvme_path) if (nvme or nvme_path) else None
        return HostCount(
            nvme,
            nvme_path,
            buffer_count,
            budget,
            budget_setting,
            budget_source,
            available,
            total,
            scratch,
            disk,
            parts,
            state,
            disk_bytes,
            need_now,
            disk_free,
        )

    def count_gpu(self, gpu_memory: int | None) -> GpuCount:
        """The device: its memory (given, this machine's, or unknown), what is usable, the step's
        peak."""
        total, source = None, "CPU"
        if self.dev == "cuda":
            total, source = _device_memory(self.device, gpu_memory)
        usable = None if total is None else (total - self.overhead) * (1 - GPU_HEADROOM)
        allocated, parts, phase = self.gpu(self.mb)
        need = allocated + self.overhead if self.acts is not None else None
        notes = (
            ()
            if self.acts is not None
            else ("no sequence length: the GPU's activations are not counted",)
        )
        return GpuCount(total, source, usable, allocated, parts, phase, need, notes)

    def largest_micro_batch(self, host: HostCount, gpu: GpuCount) -> tuple[int | None, str]:
        """(the largest b with host(b) <= budget and GPU(b) <= usable, what stops b + 1). When host
        RAM does not fit whatever the micro-batch (its state alone), the GPU alone decides (and the
        plan does not fit anyway)."""
        host_fixed = host.state + host.scratch
        host_counts = host_fixed <= host.budget or self.dev == "cpu"

        def stops(b: int) -> str | None:
            if host_counts and self.host_need(host.state, host.scratch, b) > host.budget:
                return "host RAM"
            if gpu.usable is not None and self.gpu(b)[0] > gpu.usable:
                return "GPU"
            return None

        if self.acts is not None and self.dev == "cuda" and gpu.usable is None and not self.offload:
            return None, "the GPU's memory is not known: " + gpu.source
        if self.acts is None:
            return None, "no sequence length"
        lo, hi = 0, 1
        while hi <= 1 << 24 and stops(hi) is None:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if stops(mid) is None else (lo, mid)
        limit = stops(hi) or "nothing below 16M sequences"
        if self.dev == "cuda" and gpu.usable is None:
            limit += " (the GPU's memory is not known: " + gpu.source + ")"
        if not host_counts:
            limit += (
                "; host RAM does not fit at any micro-batch (the state alone needs "
                f"{_fmt(host_fixed)})"
            )
        return lo, limit

    def verdicts(self, host: HostCount, gpu: GpuCount, max_mb: int | None) -> Verdicts:
        """What clearly does not fit (CapacityError), other problems, what to change, and the
        binding tier."""
        use = {"host RAM": host.need_now / max(host.budget, 1)}
        if host.nvme:
            use["disk"] = (
                host.disk_bytes / host.disk_free
                if host.disk_free
                else (math.inf if host.disk_bytes else 0.0)
            )
        if gpu.total is not None:
            use["GPU"] = (
                gpu.need if gpu.need is not None else self.gpu_min + self.overhead
            ) / gpu.total
        refuse, problems, advice = [], [], []
        if host.need_now > host.budget:
            self._host_verdict(host, refuse, advice)
        if host.nvme and host.disk_free is not None and host.disk_bytes > host.disk_free:
            refuse.append(
                f"disk: needs {_fmt(host.disk_bytes)} on {host.nvme_path}, {_fmt(host.disk_free)} "
                "free"
            )
            advice.append("free space on the NVMe path, or set megatrain.nvme_layers lower")
        if host.nvme and not host.nvme_path and self.dec.disk_layers:
            refuse.append(
                "disk: zero_optimization.offload_optimizer.device is nvme but no nvme_path is given"
            )
            advice.append("set zero_optimization.offload_optimizer.nvme_path")
        self._gpu_verdict(gpu, max_mb, refuse, problems, advice)
        notes = (
            ("no GPU here: GPU bytes are predicted, not checked (--gpu-memory GiB plans for one)",)
            if self.dev == "cuda" and gpu.total is None
            else ()
        )
        # RLIMIT_MEMLOCK: [Note: which limits bind host memory] (host_limits.py)
        if self.dev == "cuda":
            pinned = self.pinned_bytes(host)
            notes += tuple(
                f"page-locked host buffers about {_fmt(pinned)}: {limit}"
                for limit in pinning_limits(
                    0, pinned, memlock=memlock_limit(), cgroup=None, available=None
                )
            )
        return Verdicts(refuse, problems, advice, max(use, key=use.get), notes)

    def pinned_bytes(self, host: HostCount) -> int:
        """The host parts page-locked on CUDA (host_memory.HostRegion): the wire copy (the master
        when it is the wire), the GA landing ring, the held gradients' slabs, the offloaded layer
        inputs; not the resident parameters' small wire and landing copies."""
        pinned = ("wire copy", "landing ring", "gradient slabs", "offloaded layer inputs")
        if self.dec.wire == self.dec.master:
            pinned += (f"{self.dec.master} master",)
        return sum(v for k, v in host.parts.items() if any(p in k for p in pinned))

    def _host_verdict(self, host: HostCount, refuse: list[str], advice: list[str]) -> None:
        dec, layouts, masters, nvme = self.dec, self.layouts, self.dec.nvme_masters, host.nvme
        refuse.append(
            f"host RAM: needs {_fmt(host.need_now)}, budget {_fmt(host.budget)} "
            f"({host.budget_source})"
        )
        lean = (
            host.need_now
            - (12 if masters else 8)
            * sum(layouts[i].n_train for i in range(self.n) if i not in host.disk)
            + self.world
            * staging_buffers(host.buffer_count if nvme else NVME_BUFFER_COUNT)
            * max((nvme_layer_bytes(lay.n_train, masters) for lay in layouts), default=0)
            - sum(v for k, v in host.parts.items() if k.endswith("NVMe staging buffers"))
        )
        optimizer = self.config.optimizer is not None
        # [Note: compact moments]
        if optimizer and not nvme and dec.master != "fp32" and dec.moments == "fp32":
            compact = host.need_now - 4 * sum(layouts[i].n_train for i in range(self.n))
            advice.append(
                f"bf16.bf16_optimizer_states: true (bf16 Adam moments beside the bf16 masters, "
                "rounded "
                f"each step; host RAM then {_fmt(compact)})"
            )
        if not nvme and optimizer and lean <= host.budget:
            advice.append(
                f"set zero_optimization.offload_optimizer.device=nvme (and nvme_path): the Adam "
                "moments of "
                "trailing layers go to disk (host RAM with every layer's moments on disk: "
                f"{_fmt(lean)})"
            )
        elif optimizer and lean > host.budget:
            advice.append(
                f"even with every layer's Adam moments{' and masters' if masters else ''} on NVMe "
                "host RAM "
                f"needs {_fmt(lean)}: a host with more memory"
                + (
                    ""
                    if masters or dec.master != "fp32" or dec.compute == "fp32"
                    else ", zero_optimization.offload_param.device=nvme as well (the NVMe layers' "
                    "fp32 masters "
                    "go to disk too: about 4 host bytes per parameter are left of 16)"
                )
                + (
                    ""
                    if dec.master != "fp32" or dec.compute != "bf16"
                    else ", bf16.bf16_master_weights_and_grads: true (bf16 masters: 4 host bytes "
                    "less per "
                    "parameter)"
                )
                + ", or train adapters (LoRA: the frozen base takes 2 bytes per parameter)"
            )
        elif nvme:
            advice.append(f"megatrain.nvme_layers: \"auto\" (or more than {dec.disk_layers})")
        if self.offload:
            advice.append(
                "megatrain.offload_activations: false (the saved layer inputs then stay on the GPU)"
            )
        if host.budget_source.startswith("memory cgroup"):
            advice.append(
                "ask the scheduler for more memory (SLURM --mem, Kubernetes "
                "resources.limits.memory, "
                "docker --memory): the memory cgroup's limit binds"
            )
        elif host.budget_setting not in (None, "auto"):
            advice.append(
                f"raise megatrain.host_memory_budget (MemAvailable here: {_fmt(host.available)})"
            )

    def _gpu_verdict(
        self,
        gpu: GpuCount,
        max_mb: int | None,
        refuse: list[str],
        problems: list[str],
        advice: list[str],
    ) -> None:
        gpu_over, mb, acts = False, self.mb, self.acts
        if gpu.total is not None:
            need_now = gpu.need if gpu.need is not None else self.gpu_min + self.overhead
            if need_now > gpu.total:
                gpu_over = True
                refuse.append(
                    f"GPU: needs {_fmt(need_now)} at micro-batch {mb}"
                    f"{'' if acts is not None else ' before any activation'}, the device has "
                    f"{_fmt(gpu.total)}"
                )
            elif gpu.need is not None and gpu.allocated > gpu.usable:
                problems.append(
                    f"GPU: needs {_fmt(gpu.need)} at micro-batch {mb}: less than {GPU_HEADROOM:.0%}"
                    " "
                    f"of the device's {_fmt(gpu.total)} stays free for fragmentation"
                )
                gpu_over = True
        if gpu_over and acts is not None:
            if max_mb:
                advice.append(
                    f"lower the micro-batch to {max_mb} (train_micro_batch_size_per_gpu; raise "
                    "gradient_accumulation_steps to keep the batch)"
                )
            if not self.offload:
                advice.append(
                    f"megatrain.offload_activations: true (the saved layer inputs, "
                    f"{_fmt(self.n * acts.input_bytes(mb))} per GPU, move to pinned host memory)"
                )
            if self.dec.keep:
                advice.append("megatrain.keep_activations: 0")
            if self.dec.n_device_layers:
                advice.append("megatrain.gpu_optimizer_layers: 0")
        elif gpu_over:
            advice.append(
                "megatrain.num_slots: 2, gpu_optimizer_layers: 0, keep_activations: 0; or a larger "
                "GPU"
            )

    def prediction(
        self,
        model_name: str,
        seq: int | None,
        host: HostCount,
        gpu: GpuCount,
        largest: tuple[int | None, str],
        verdict: Verdicts,
    ) -> Prediction:
        dec, resident, acts = self.dec, self.resident, self.acts
        max_mb, limit = largest
        return Prediction(
            model=model_name,
            n_layers=self.n,
            params=sum(lay.numel for lay in self.layouts) + sum(m for m, _ in resident),
            trainable=sum(lay.n_train for lay in self.layouts) + sum(m for m, t in resident if t),
            compute=dec.compute,
            wire=dec.wire,
            grad=dec.grad,
            ga=dec.ga,
            micro_batch=self.mb,
            seq=seq if acts is not None else None,
            world=self.world,
            device=self.dev,
            host_parts=host.parts,
            host_state_bytes=host.state,
            host_need_bytes=host.need_now,
            host_budget_bytes=host.budget,
            host_budget_source=host.budget_source,
            host_available_bytes=host.available,
            host_total_bytes=host.total,
            nvme=host.nvme,
            nvme_path=host.nvme_path,
            disk_layers=dec.disk_layers,
            nvme_masters=dec.nvme_masters,
            disk_bytes=host.disk_bytes,
            disk_free_bytes=host.disk_free,
            gpu_parts=gpu.parts if self.dev == "cuda" else {},
            gpu_phase=gpu.phase,
            gpu_allocated_bytes=gpu.allocated if acts is not None else None,
            gpu_min_bytes=self.gpu_min,
            gpu_overhead_bytes=self.overhead,
            gpu_total_bytes=gpu.total,
            gpu_source=gpu.source,
            max_micro_batch=max_mb,
            max_micro_batch_limit=limit,
            binding=verdict.binding,
            fits=not verdict.refuse,
            problems=verdict.refuse + verdict.problems,
            advice=verdict.advice,
            notes=[*dec.notes, *gpu.notes, *verdict.notes],
            decisions=dec,
        )


def _device_memory(device: torch.device, gpu_memory: int | None) -> tuple[int | None, str]:
    """(the GPU's bytes, where that number comes from): ``--gpu-memory``, this machine's GPU, or
    unknown."""
    if gpu_memory is not None:
        return int(gpu_memory), f"--gpu-memory {_fmt(int(gpu_memory))}"
    if torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.mem_get_info(index)[
            1
        ], f"{torch.cuda.get_device_name(index)} (cuda:{index})"
    return None, "no GPU here (--gpu-memory GiB plans for one)"
