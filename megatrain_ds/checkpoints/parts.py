"""What a checkpoint is made of: the engine's parts that save, load, the 16-bit export and the peft
adapter read and write, handed to them as one value (``CheckpointParts``), never the engine itself.

The engine builds it at each call (``engine.checkpoint_parts()``), so every field is what the
engine holds at that moment: ``initialize`` attaches the scheduler after the engine is built, and
a script may replace it. What a load changes in the engine goes through the parts: the counters in
place (``StepCounters.load_state``), the weights through ``load_master_state_dict``, the moments
through ``layer_states`` and ``resident``. What a save learns comes back as its result
(``CheckpointSaved``), which the engine keeps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from ..host import HostLayerStore, LayerStates, ModelState
    from ..optim import HostAdamW, LossScaler, ResidentParams
    from ..parallel import DataParallel
    from ..planning import TrainConfig
    from .checkpoint_stream import SaveTimes
    from .step_counters import StepCounters


@dataclass(frozen=True)
class CheckpointParts:
    """The engine's state a checkpoint saves and loads, and the calls it makes on the engine."""

    # the wrapped model: its names, buffers, frozen flags, hf config, peft adapter
    module: torch.nn.Module
    # the streamed layers' list in the module: layer i's names are ``<block_name>.<i>.<slot>``
    block_name: str
    layer_states: LayerStates  # where each streamed layer's masters and moments live
    store: HostLayerStore  # the host buffers: the dtype frozen weights are kept in
    resident: ResidentParams  # the parameters outside the streamed layers: masters, moments
    layer_buffers: list[dict[str, torch.Tensor]]  # the executor's device copies of layer buffers
    optimizer: HostAdamW | None  # param groups and step count; None: no optimizer
    lr_scheduler: Any  # initialize's scheduler, or None
    counters: StepCounters  # the engine's step counters (a load sets them in place)
    settings: TrainConfig  # the parsed config: accumulation steps, batch size
    loss_scaler: LossScaler | None  # fp16's live loss scaler (a load sets it in place); None: none
    ds_config: dict  # the DeepSpeed config dict, as saved (and read by wayback.py)
    compute_dtype: torch.dtype
    dp: DataParallel | None  # the data-parallel group; None or inactive: one process
    synchronize: Callable[[], None]  # waits for every queued host task and device work
    sync_masters_to_host: Callable[[], None]  # synchronize, then GPU-held state to the host
    load_master_state_dict: Callable[..., None]  # (state, strict=): weights into every copy
    deepspeed_resume_said: bool  # a save already warned that real DeepSpeed could not resume it
    model_state: ModelState | None = None  # every parameter's home: master, moments, any kind


@dataclass(frozen=True)
class CheckpointSaved:
    """What one save learned: its phases' times, and whether DeepSpeed's resume is warned about."""

    times: SaveTimes
    deepspeed_resume_said: bool
