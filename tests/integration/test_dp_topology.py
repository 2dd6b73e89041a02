"""Who holds what under data parallel (dp.py's ``Topology``, ``resident_positions``; pure, no
process group), and the planner's host bytes per host with it (capacity.py): one host copy of every
persistent tensor however many ranks, one copy per node with ``host_sharding: "node"``, 1/nodes of
one with ``"job"``."""

import pytest

from megatrain_ds.planning import plan
from megatrain_ds.parallel.dp import Topology, resident_positions
from megatrain_ds.errors import ConfigError


def test_one_shard_per_node_and_ownership_by_position():
    # two torchrun nodes of 2 ranks (ranks numbered node by node), then the same keys out of order
    topo = Topology.of([("0", "a"), ("0", "a"), ("1", "b"), ("1", "b")])
    assert topo.shards == topo.nodes == ((0, 1), (2, 3)) and topo.size == 2
    assert [topo.position(r) for r in range(4)] == [0, 1, 0, 1]
    # replicas
    assert topo.owned_mask(0, 5) == topo.owned_mask(2, 5) == [True, False, True, False, True]
    assert topo.owned_mask(3, 5) == [False, True, False, True, False]
    odd = Topology.of(["x", "y", "x", "y"])
    assert odd.shards == ((0, 2), (1, 3)) and odd.owned_mask(2, 3) == [False, True, False]
    # "job": one shard of every rank, each node holding its ranks' share (1/nodes of the state)
    job = Topology.of([("0", "a"), ("0", "a"), ("1", "b"), ("1", "b")], "job")
    assert (
        job.shards == ((0, 1, 2, 3),) and job.nodes == ((0, 1), (2, 3)) and job.owned_mask(2, 5)[2]
    )
    # one node: both modes are one shard of every rank
    assert Topology.of(["h"] * 3).shards == Topology.of(["h"] * 3, "job").shards == ((0, 1, 2),)
    # two "nodes" of one rank each on one machine (torchrun --nnodes 2 on localhost): two hosts,
    # each holding all
    local = Topology.of([("0", "localhost"), ("1", "localhost")])
    assert local.shards == ((0,), (1,)) and local.owned_mask(1, 3) == [True] * 3
    assert Topology.uniform(2, 2).shards == topo.shards


def test_nodes_of_different_sizes_need_job_sharding():
    from megatrain_ds.planning.config import MegatrainSettings

    with pytest.raises(ConfigError, match="same number of ranks.*host_sharding"):
        Topology.of(["a", "a", "b"])
    assert Topology.of(["a", "a", "b"], "job").shards == ((0, 1, 2),)
    assert MegatrainSettings().host_sharding == "node"
    with pytest.raises(ConfigError, match="host_sharding"):
        MegatrainSettings(host_sharding="host")


def test_resident_parameters_go_largest_first_to_the_least_loaded_position():
    # an untied model: embedding, final norm, head (the 14B's: 778 M, 5 K, 778 M)
    resident = [(778_567_680, True), (5_120, True), (778_567_680, True)]
    assert resident_positions(resident, 2) == [0, 0, 1]  # embedding and head on different ranks
    assert resident_positions(resident, 1) == [0, 0, 0]
    assert resident_positions(resident, 4) == [0, 2, 1]
    # frozen ones (LoRA) have no state to own
    assert resident_positions([(10, False), (4, True), (6, True)], 2) == [None, 1, 0]
    topo = Topology.uniform(1, 2)
    assert topo.resident_mask(1, [None, 1, 0]) == [True, True, False]
    # "job" sharding over 2 nodes of 2: dealt to the first rank of each node first (embedding and
    # head on two hosts)
    job = Topology.uniform(2, 2, "job")
    assert job.position_order() == [0, 2, 1, 3] and Topology.uniform(2, 2).position_order() == [
        0,
        1,
    ]
    assert resident_positions(resident, 4, job.position_order()) == [0, 1, 2]


def _tiny(layers: int = 4):
    from models import tiny_hf

    return tiny_hf("qwen2", tied=False, layers=layers)


def test_plan_holds_the_host_state_once_per_host():
    """2 ranks on a host hold what 1 process holds (layers and resident parameters alike); with
    gradient_hold "gpu" the layers' gradients leave the host on every rank (three slabs each
    instead)."""
    model = _tiny(12)
    config = plan.load_train_config(
        {
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "AdamW"},
            "bf16": {"enabled": True},
            "megatrain": {"stream_fp32_master": True},
        }
    )
    one = plan.plan_model(model, config, device="cuda", gpu_memory=80 * 2**30)
    two = plan.plan_model(model, config, device="cuda", world=2, gpu_memory=80 * 2**30)
    assert two.host_state_bytes == one.host_state_bytes
    held = plan.plan_model(
        model,
        plan.load_train_config(
            {**config.raw, "megatrain": {"stream_fp32_master": True, "gradient_hold": "gpu"}}
        ),
        device="cuda",
        world=2,
        gpu_memory=80 * 2**30,
    )
    grads = next(
        v for k, v in two.host_parts.items() if k.startswith("layers:") and k.endswith("gradients")
    )
    slabs = next(v for k, v in held.host_parts.items() if "slabs" in k)
    assert (
        held.decisions.grad_hold
        and two.host_state_bytes - held.host_state_bytes == grads - slabs > 0
    )
    # per GPU: each rank holds the gradients of the layers it owns
    per_gpu = next(v for k, v in held.gpu_parts.items() if "held until the norm" in k)
    # (12 equal layers, 6 on rank 0; bf16 gradients held, bf16 landed on the host)
    assert per_gpu * 2 == grads


def test_plan_for_several_nodes():
    """--nodes: "node" sharding holds a whole copy on every node (the same host bytes as one node);
    "job" holds 1/nodes of the layers on each node."""
    model = _tiny()
    config = plan.load_train_config(
        {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"}}
    )
    node = plan.plan_model(model, config, device="cpu", world=2)
    nodes = plan.plan_model(model, config, device="cpu", world=2, nodes=2)
    job = plan.plan_model(model, config, device="cpu", world=2, nodes=2, sharding="job")
    assert nodes.host_state_bytes == node.host_state_bytes
    layers = lambda p: sum(  # noqa: E731
        v for k, v in p.host_parts.items() if k.startswith("layers:")
    )
    assert layers(job) * 2 == layers(node)  # an even layer count: half on each node
