"""The capacity check: host RAM, disk and GPU bytes of a run, predicted before anything is built,
and refused when they clearly do not fit.

``check_capacity`` sums, for a run's ``Decisions`` (decisions.py), what the engine will hold on
every tier, by the same rules as the code that allocates it (host_bytes.py for the host's buffers,
plan_gpu.py's ``ActivationModel`` for the step's GPU working set), and returns a ``Prediction`` (the
table the CLI and the engine print), or raises ``CapacityError`` with the numbers. The engine calls
it with its own decisions before it builds a buffer (engine_build.py); ``megatrain-ds plan`` calls
it through plan.py's ``plan_model``, which resolves the decisions for the whole host. This module
owns the check and the model of memory below; capacity_count.py's ``Counting`` does the sums, the
verdicts (which tier binds, what to change) and the largest micro-batch, and prediction.py holds
``Prediction``. It decides nothing about the run itself.

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

import torch

from .settings import TrainConfig
from .decisions import Decisions, HostShare, resolve
from ..parallel import Topology, resident_positions
from .host_bytes import resident_items

# check_capacity's argument host_budget is the setting
from .host_bytes import host_budget as measure_budget
from ..model import LayerLayout
from .plan_gpu import ActivationModel
from .prediction import Prediction, fmt_bytes as _fmt  # noqa: F401 (capacity._fmt)

# re-exported: the counting's constants and steps' values (capacity_count.py)
from .capacity_count import (  # noqa: F401
    CUBLAS_WORKSPACE_BYTES,
    CUBLAS_WORKSPACE_BYTES_PRE_HOPPER,
    CUDA_CONTEXT_BYTES,
    GPU_HEADROOM,
    NCCL_BYTES,
    Counting,
    GpuCount,
    HostCount,
    Verdicts,
)


class CapacityError(RuntimeError):
    """The predicted memory clearly exceeds what this machine has; the message gives the numbers
    (needed vs available per tier), which limit binds and what to change. ``prediction`` holds the
    whole plan."""

    def __init__(self, message: str, prediction: "Prediction") -> None:
        super().__init__(message)
        self.prediction = prediction


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

    def tally(dec: Decisions) -> Counting:
        return Counting(
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
