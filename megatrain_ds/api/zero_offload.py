"""``engine.optimizer.parameter_offload`` (DeepSpeed's ``DeepSpeedZeRoOffload`` face) and forwards
under ``GatheredParameters``: what RL libraries touch to generate between ZeRO-3 training steps.

[Note: generation under ZeRO-3] TRL's ``unwrap_model_for_generation`` (trl/models/utils.py) with
``ds3_gather_for_generation=True`` (its default; GRPO, RLOO, online DPO, GKD) does, on DeepSpeed::

    # every partition all-gathered onto the GPU
    with deepspeed.zero.GatheredParameters(engine.parameters()):
        # engine.optimizer.parameter_offload (or the optimizer): each parameter's
        # ds_active_sub_modules cleared; forward_hooks / backward_hooks removed, emptied
        remove_hooks(engine)
        # module.generate(...) on the gathered weights, no per-module fetch and release
        yield engine.module
        # parameter_offload._register_deepspeed_module(parameter_offload.module)
        add_hooks(engine)

and with ``False`` it yields the module as it is (each module fetches its partitions as it runs).
megatrain_ds answers both the same way, and never copies the model to the GPU for it:

- **A forward computes on the engine's weights, gathered or not.** A streamed layer runs through its
  route into the executor (a slot, or the inference cache's buffer when the layers fit: [Note:
  inference cache]); a resident parameter (embeddings, final norm, head) on its device copy in the
  compute dtype. Gathering changes what ``param.data`` shows (an fp32 copy of the master: in host
  memory for a streamed parameter, on the device for a resident one: zero.py) and not what a forward
  computes with, so a generate inside a whole-model gather streams or caches exactly as one outside
  it, and gives the same tokens. The streamed layers' routes ignore ``param.data`` already; for the
  resident parameters the block installs ``DeviceCopies``: each module owning some gets a pre-hook
  pointing their ``param.data`` at the device copy for its forward, and a post-hook giving the
  gathered copy back. The block first makes the device copies current (``ResidentParams.upload``:
  the last step's update is waited for), so the engine's own upload never writes into a gathered
  copy. An edit to a gathered parameter reaches a forward once written back (``modifier_rank``, at
  the block's end), for resident and streamed ones alike (on DeepSpeed the forward would see it at
  once); so does a cast (TRL's paged generation casts the unwrapped model, ``.to(bfloat16)``,
  ``lm_head.to(float32)``: here the gathered copies only, discarded at the end). Generation runs
  under ``no_grad``; a grad-enabled forward in a block would leave a resident module's backward
  reading the gathered copy (a dtype or device error where it differs from the compute copy).
- **``forward_hooks``: the fetch hooks that can be removed.** One forward pre-hook per module owning
  resident parameters refreshes their device copies before it runs, for a module called without the
  engine (the HF Trainer's evaluation of ``trainer.model``, ``generate``). Removing them is what
  DeepSpeed's removal is: the module then computes on what was fetched last, which inside a gather
  is current (the block made it so) and stays current until the next step.
  ``_register_deepspeed_module`` (and DeepSpeed's older name ``_register_hooks_recursively``)
  installs each missing one once: a remove/add round trip, or a second add, leaves one per module. A
  streamed layer's route is not a hook and is never removed: without it the layer would compute on
  parameters that hold no storage.
- **``backward_hooks`` is empty**: the engine's backward runs through its autograd Function
  (executor.py), not through module hooks.
- **``param.ds_active_sub_modules``** (zero.py): DeepSpeed's set of submodules computing with the
  parameter at this moment. Empty wherever code outside a forward can look, as DeepSpeed's is
  between forwards: the executor holds a layer's weights only inside the layer's call.
- **``module.ds_external_parameters()``**: DeepSpeed's parameters registered with a module from
  outside it (trl's ``iter_params`` calls it on the root); none here.

Costs: the whole-model gather reads every fp32 master into a copy, for the block's duration: 4 bytes
per streamed parameter of host memory, 4 per resident one of device memory;
``ds3_gather_for_generation=False`` generates the same tokens without them. Under the gather HF's
``model.dtype`` (its first floating parameter's) reads fp32 where DeepSpeed's reads the compute
dtype; ``generate`` uses it only to build a static cache's masks. An engine without an optimizer (a
frozen reference) has ``optimizer is None``, for which trl raises before touching anything.
"""

from __future__ import annotations

from typing import Callable

import types

from torch import nn


def _no_external_parameters(self):
    """DeepSpeed's ``module.ds_external_parameters()``: (name, parameter) pairs used by the module
    but owned elsewhere. megatrain_ds registers none."""
    return ()


def _owners(module: nn.Module, ids: set[int]) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """Each submodule of ``module`` owning (``recurse=False``) some of the parameters ``ids``, with
    them."""
    out = []
    for m in module.modules():
        mine = [p for p in m.parameters(recurse=False) if id(p) in ids]
        if mine:
            out.append((m, mine))
    return out


class ParameterOffload:
    """``engine.optimizer.parameter_offload``: the module, its removable fetch hooks
    (``forward_hooks``), and the registration that puts them back. See [Note: generation under
    ZeRO-3]."""

    def __init__(
        self, upload: Callable[[], None], module: nn.Module, resident: list[nn.Parameter]
    ) -> None:
        # the resident parameters' refresh: their device copies from the last update
        self._upload = upload
        self.module = module
        # modules owning resident parameters
        self._owners = _owners(module, {id(p) for p in resident})
        # id(owner) -> its refresh hook's handle, while installed
        self._handles: dict[int, object] = {}
        self.forward_hooks: list = []  # what trl's remove_hooks removes and then replaces with []
        # always empty: the backward is the executor's autograd Function
        self.backward_hooks: list = []
        self._register_deepspeed_module(module)

    def _refresh(self, _module, _args) -> None:
        self._upload()  # a no-op when the device copies hold the last update

    def _register_deepspeed_module(self, module: nn.Module, count=None) -> None:
        """DeepSpeed's name (trl's ``add_hooks``): install the refresh hook of each owner of
        resident parameters under ``module`` that has none now, and give every submodule
        ``ds_external_parameters``. ``count`` (DeepSpeed's module numbering) is accepted and
        unused."""
        under = {id(m) for m in module.modules()}
        for m in module.modules():
            if not hasattr(m, "ds_external_parameters"):
                m.ds_external_parameters = types.MethodType(_no_external_parameters, m)
        for owner, _ in self._owners:
            if id(owner) not in under:
                continue
            handle = self._handles.get(id(owner))
            if handle is not None and handle.id in owner._forward_pre_hooks:
                continue  # installed (a second add, or removed by someone and put back)
            handle = owner.register_forward_pre_hook(self._refresh)
            self._handles[id(owner)] = handle
            self.forward_hooks.append(handle)

    # DeepSpeed < 0.16.4's name (older trl calls it)
    _register_hooks_recursively = _register_deepspeed_module

    def destroy(self) -> None:
        """``engine.destroy()``: the module outlives the engine; the hooks calling into it must
        not."""
        for handle in self._handles.values():
            handle.remove()
        self._handles.clear()
        self.forward_hooks = []


class DeviceCopies:
    """While a ``GatheredParameters`` block holds resident parameters' fp32 copies in
    ``param.data``, each module owning some runs its forward on the engine's device copies
    (``param.ds_tensor``, what ``param.data`` is outside a block); see [Note: generation under
    ZeRO-3]. Its pre-hook runs first (``prepend``), so the refresh hook's upload, should it have
    work, writes into the device copies. Nested blocks and re-entrant calls: a parameter already on
    its device copy is left alone, so only the hook that moved it moves it back."""

    def __init__(self, module: nn.Module, params: list[nn.Parameter]) -> None:
        self.handles = []
        for owner, mine in _owners(module, {id(p) for p in params}):
            # per forward in progress: the (param, host copy) pairs this hook swapped
            held: list[list] = []
            self.handles.append(owner.register_forward_pre_hook(_binder(mine, held), prepend=True))
            self.handles.append(owner.register_forward_hook(_unbinder(held), always_call=True))

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _on_device_copy(p: nn.Parameter) -> bool:
    """``param.data`` is the device copy's storage (``.data`` makes a new tensor object at each
    access)."""
    return p.device == p.ds_tensor.device and p.data_ptr() == p.ds_tensor.data_ptr()


def _binder(params, held):
    def bind(_module, _args):
        swapped = [(p, p.data) for p in params if not _on_device_copy(p)]
        for p, _ in swapped:
            p.data = p.ds_tensor
        held.append(swapped)

    return bind


def _unbinder(held):
    def unbind(_module, _args, _output):
        if held:
            for p, host in held.pop():
                p.data = host

    return unbind
