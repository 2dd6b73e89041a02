"""``generate()`` and evaluation inside a training loop: no-grad forwards on device-resident
weights.

[Note: inference cache] A training forward streams every layer H2D once (and its backward once
more), which is the point of the engine. A no-grad forward does the same by default, and
``generate()`` of K tokens runs K forwards: K times the model over PCIe. When the streamed layers
fit on the device in the compute dtype, the cache uploads each layer once into a buffer of its own
and binds the templates to it for every later no-grad forward. The policy, as implemented by
``InferenceCache.acquire`` (one call per layer call of ``run_forward``):

- **When.** A layer call without grad (``torch.no_grad``, ``torch.inference_mode``; ``model.eval()``
  changes nothing by itself) while the cache is idle decides, once, whether this run of no-grad
  forwards uses it. Never while a backward is pending (a grad-enabled forward ran since the last
  backward: the cache would hold device memory through that backward's recomputes); otherwise from
  ``megatrain.inference_cache`` ``true``: yes; ``false``: no; ``"auto"`` (default): yes on CUDA, in
  one process, when the layers' bytes in the compute dtype (kept layers excepted: they have device
  buffers already) are at most ``megatrain.inference_cache_memory`` (0.5) of the free device memory
  (the driver's free bytes plus what PyTorch's caching allocator holds unused), i.e. after
  everything the engine holds. On CPU ``"auto"`` is off: the "device" is host memory, and a cache
  would be a second copy of the model there (``true`` still turns it on: it is how the tests
  exercise the policy). A "no" is re-examined at the next forward (its layer 0 call), so memory
  freed later is used.
- **Which bytes.** Each layer is uploaded (``StreamedLayers._load`` into the cache's buffer: the
  same wait for the optimizer's rewrite of the wire copy, the same fp32 stage + cast, the same
  data-parallel broadcast from the owner) on its first use, and layer i+1's upload is issued before
  layer i computes, as streaming prefetches. A cached layer is reused while its version
  (``LayerSchedule.version``) is the one it was uploaded at: an optimizer step, a speculation
  rollback, ``load_master_state_dict`` or a ``GatheredParameters`` write bumps the version of the
  layers it changes, and only those are uploaded again at their next use.
- **Until.** The first grad-enabled layer call (a training forward, made through the autograd
  Function) frees every buffer of the cache before it runs: training never shares the device with
  it, and the memory returns to PyTorch's caching allocator for the step's activations. (Weights
  change at every step anyway, so a rollout after a step would upload every layer again in any
  case.) ``release()`` frees it on request; ``engine.destroy()`` frees it too.
- **Otherwise** no-grad forwards stream each layer from the host wire copy per call, as before.
- **How a cached layer runs.** A decode step calls every layer once per token, so the per-call cost
  of binding a shared template (``functional_call``: swapping each parameter in and out, per call)
  is paid layers × tokens times; on a 1.5B model it made the engine's generate about twice a plain
  model's. A cached layer gets a module of its own instead (``bound``): a copy of layer i's template
  (its tiling and kernels, layer i's overlays such as ``layer_idx``) whose parameters are set once
  to views of its cache buffer (or of its kept buffer: a kept layer is not copied into the cache)
  and whose buffers are the executor's, so a call is the layer's plain forward. It is built once per
  layer and re-pointed only when its buffer changes; ``release`` (the next training forward) lets go
  of the buffers. Layers with a parameter shared with another layer or tied inside the layer keep
  ``functional_call``.

Data parallel (dp.py): every rank runs the same forwards, so every rank's cache uploads layer i at
the same point and the upload is ``_load``'s broadcast from i's owner, once per version instead of
once per forward. The decision must then agree across ranks: ``"auto"`` does not cache under data
parallel (free memory differs per rank, and a decision taken inside a forward would need a
collective); ``true`` caches on every rank (tested on CPU/gloo with 2 ranks in
tests/engine/test_generate.py).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..model import HOOK_DICTS, submodule_pairs
from .slot import Slot


class InferenceCache:
    """Device-resident copies of the streamed layers for no-grad forwards; see [Note: inference
    cache]."""

    def __init__(
        self, executor, setting: bool | str = "auto", memory_fraction: float = 0.5
    ) -> None:
        self.ex = executor
        self.setting = setting  # True | False | "auto" (megatrain.inference_cache)
        self.memory_fraction = float(memory_fraction)  # megatrain.inference_cache_memory
        self.slots: dict[int, Slot] = {}  # layer -> its buffer while the cache is on
        # "idle": undecided; "on": no-grad forwards use the cache; "off": they stream
        self.state = "idle"
        self.reason = ""  # why the last decision went the way it did (shown by ``describe``)
        self.builds = 0  # times the cache was turned on (buffers allocated)
        self.releases = 0  # times a grad-enabled forward (or release()) freed it
        # layer -> [its own module, the slot its parameters point into, (template submodule, layer
        # submodule)]
        self.modules: dict[int, list] = {}

    # --- policy -----------------------------------------------------------------------------------
    def acquire(self, i: int, training: bool) -> Slot | None:
        """The slot layer ``i`` runs from in this call, ready on the compute stream; None: stream it
        as usual. A grad-enabled call (``training``) frees the cache and returns None."""
        if training:
            if self.state != "idle":
                self.release()
            return None
        if self.state == "idle" or (self.state == "off" and i == 0):
            self._decide()
        if self.state != "on":
            return None
        slot = self._ready(i)
        if i + 1 < len(self.ex.layouts):
            # the next layer's upload (if stale) overlaps this one's compute, as streaming
            self._ready(i + 1)
        self.ex.streams.wait(self.ex.streams.compute(), slot.ready)
        return slot

    def release(self) -> None:
        """Free the cache's device buffers (PyTorch's caching allocator gets them back); the next
        no-grad forward decides again."""
        if self.slots:
            self.releases += 1
        self.slots = {}
        self.state = "idle"
        # the layers' own modules let go of the buffers (so they are freed)
        for entry in self.modules.values():
            if entry[1] is not None:
                for sub in entry[0].modules():
                    for leaf in sub._parameters:
                        sub._parameters[leaf] = None
                entry[1] = None

    def bound(self, i: int, slot: Slot) -> nn.Module | None:
        """Layer i's own module with its parameters in ``slot`` (a buffer of this cache, or a kept
        layer's own), ready to call; None where the layer must go through ``functional_call`` (a
        parameter shared with another layer, or tied inside it; a streaming slot)."""
        ex = self.ex
        template = ex.templates[ex.template_of[i]]
        # a kept or weight-cached layer's buffer serves it too
        ours = slot is self.slots.get(i) or (slot is not None and slot is ex.own_slot(i))
        if (
            not ours
            or ex.shared[i]
            or ex.tie_weights[ex.template_of[i]]
            # (a forward patched on the layer: the template's path)
            or "forward" in template.__dict__
        ):
            return None
        entry = self.modules.get(i)
        # layer i's template as the executor runs it (its tiling, its kernels), with i's overlays
        if entry is None:
            module = copy.deepcopy(template)  # (parameters on the meta device until bound below)
            paths = {id(sub): path for path, sub in template.named_modules()}
            for sub, name, value in ex.overlays[i]:  # e.g. layer_idx, sliding_window of layer i
                setattr(module.get_submodule(paths[id(sub)]), name, value)
            entry = self.modules[i] = [module, None, submodule_pairs(module, ex.layers[i])]
        module, bound_to, pairs = entry
        if bound_to is not slot:  # (the cache was built again: a new buffer)
            views = ex._bind(i, slot, None, shared={})
            for name, tensor in views.items():
                owner, _, leaf = name.rpartition(".")
                sub = module.get_submodule(owner)
                if leaf in sub._parameters:
                    sub._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
            entry[1] = slot
        # the executor's device buffers (what state_dict() sees)
        for name, tensor in ex.buffers[i].items():
            owner, _, leaf = name.rpartition(".")
            module.get_submodule(owner)._buffers[leaf] = tensor
        if module.training != ex.layers[i].training:
            module.train(ex.layers[i].training)
        # layer i's submodule hooks, by reference, as the templates get them
        for mirror, original in pairs:
            for attr in HOOK_DICTS:
                mirror.__dict__[attr] = original.__dict__[attr]
        return module

    def cached_layers(self) -> list[int]:
        """The layers that get a buffer of the cache: all but the kept and weight-cached ones (they
        have a device buffer already, reloaded only when their version changes)."""
        ex = self.ex
        return [i for i in range(len(ex.layouts)) if ex.own_slot(i) is None]

    def nbytes(self) -> int:
        """Device bytes the cache takes when on: the cached layers in the compute dtype."""
        size = self.ex.slots[0].buf.element_size()
        return sum(self.ex.layouts[i].numel for i in self.cached_layers()) * size

    def pending_bytes(self) -> int:
        """Device bytes the next no-grad forward may allocate for the cache: none when it is on
        already (its buffers are allocated, so not free), off by setting, or "auto" where it never
        caches (CPU, data parallel); else ``nbytes``."""
        ex = self.ex
        if self.state == "on" or self.setting is False:
            return 0
        if self.setting == "auto" and (ex.device.type != "cuda" or ex.dp is not None):
            return 0
        return self.nbytes()

    def describe(self) -> str:
        return f"inference cache {self.state} ({self.reason or 'undecided'})"

    def _decide(self) -> None:
        need, ex = self.nbytes(), self.ex
        if self.setting is False:
            on, self.reason = False, "megatrain.inference_cache is false"
        # e.g. a DPO reference pass between the policy's forward and backward
        elif any(ex.schedule.forward_calls):
            on, self.reason = (
                False,
                "a backward is pending (a grad-enabled forward ran since the last backward)",
            )
        elif self.setting is True:
            on, self.reason = True, "megatrain.inference_cache is true"
        elif ex.device.type != "cuda":
            on, self.reason = (
                False,
                "\"auto\" caches on CUDA only (on CPU the host already holds the layers)",
            )
        elif ex.dp is not None:
            on, self.reason = (
                False,
                "\"auto\" does not cache under data parallel (set true to cache on every rank)",
            )
        else:
            free, _ = torch.cuda.mem_get_info(ex.device)
            free += torch.cuda.memory_reserved(ex.device) - torch.cuda.memory_allocated(ex.device)
            on = need <= self.memory_fraction * free
            self.reason = (
                f"{need / 2**30:.2f} GiB of layers {'<=' if on else '>'} {self.memory_fraction:g} "
                "x "
                f"{free / 2**30:.2f} GiB free"
            )
        self.state = "off"
        if on:
            try:
                for i in self.cached_layers():
                    self._allocate(i)
            except torch.OutOfMemoryError:
                self.slots = {}
                if self.setting is True:
                    raise
                self.reason += "; allocation failed"
                return
            self.state = "on"
            self.builds += 1

    # --- buffers ----------------------------------------------------------------------------------
    def _allocate(self, i: int) -> Slot:
        ex = self.ex
        # a buffer made under inference_mode could not be refreshed outside it
        with torch.inference_mode(False):
            buf = torch.empty(ex.layouts[i].numel, dtype=ex.slots[0].buf.dtype, device=ex.device)
        # written on h2d: not reused before its copies are done
        ex.streams.hand_over(buf, ex.streams.h2d)
        # the fp32 stage (fp32 master streamed, cast on the device) is used on h2d only, in order:
        # the slots may share it
        slot = Slot(buf, ex.slots[0].stage)
        self.slots[i] = slot
        return slot

    def _ready(self, i: int) -> Slot:
        """Layer i's cached slot, its upload issued if it holds no copy of the current version."""
        ex = self.ex
        slot = self.slots.get(i)
        # a kept or weight-cached layer: its own buffer, reloaded only when its version changed
        if slot is None and ex.own_slot(i) is not None:
            return ex._find(i) or ex._load(i, busy=None, direction="cache")
        if slot is None:  # the kept layers changed since the cache was built
            slot = self._allocate(i)
        if slot.layer != i or slot.version != ex.version[i]:
            ex._load(i, busy=None, slot=slot, direction="cache")
        return slot
