"""The machines a plan is predicted on: GPUs and the network between nodes, each figure with its source.

    scale.predict(plan, hardware="h100-sxm", network="ib-400g")

Peak FLOPs are dense (NVIDIA's datasheets print the sparse figure, twice these, with an asterisk).
Link bandwidths are per GPU and per direction: NVLink's "900 GB/s" is both directions of 18 links,
450 GB/s each way; a 400 Gb/s NIC moves 50 GB/s each way. ``latency_s`` is each step of a ring's
cost in the latency-bandwidth model (``theory.collective_time_s``); it is an assumption (no datasheet
prints it), stated here so that its effect can be seen. On a node's 8 GPUs it adds little to a large
model's megabyte-sized collectives; a ring over 1,024 GPUs pays 1,023 of them per phase (5 ms per
collective at 5 us) where NCCL runs a ring; the predictor charges each collective the algorithm NCCL
would pick (``theory.algorithm_times``: a tree's latency grows with log2 of the nodes).

``scale.calibrate(lab)`` makes the same two objects from a lab's own measurements, for the lab.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

__all__ = ["HARDWARE", "NETWORKS", "Hardware", "Network", "hardware_named", "network_named"]

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    """A GPU and its node: what a plan's compute, memory and intra-node collectives run on."""

    name: str
    #: Dense peak FLOP/s by precision ("bf16", "fp8", "fp32": TF32 tensor cores, which torch uses for
    #: fp32 matmuls when allowed).
    peak_flops: dict[str, float]
    memory_bytes: float
    memory_bytes_per_s: float
    gpus_per_node: int
    #: NVLink (or the node's fabric), per GPU, one direction.
    node_link_bytes_per_s: float
    node_link_latency_s: float
    source: str
    #: The fraction of the peak a training step's compute reaches on this machine, where it was measured
    #: (``scale.calibrate``); None: the predictor's ``EFFICIENCY``, fitted on a published run.
    efficiency: float | None = None
    #: The share of a collective's time that compute running beside it hides: 1 where communication has
    #: engines of its own (a GPU's copy engines and NCCL's kernels beside the matmuls); 0 for a CPU lab
    #: (``scale.calibrate``), where FSDP2, which overlaps through CUDA streams, waits for each collective.
    overlap: float = 1.0
    #: (bandwidth, latency) of the node's link per collective where they were fitted apart (``scale.calibrate``:
    #: gloo's reduce-scatter moves an all-reduce's bytes); otherwise every op uses the two above.
    node_link_by_op: dict[str, tuple[float, float]] = field(default_factory=dict)
    #: Its collectives run on NCCL, which picks an algorithm per call (``theory.algorithm_times``);
    #: False: every collective is a ring (gloo on a lab, ``scale.calibrate``).
    nccl: bool = False
    #: The node's GPUs sit on NVSwitches that reduce (NVLink SHARP, Hopper and later): NCCL's NVLS.
    nvls: bool = False


@dataclass(frozen=True)
class Network:
    """The network between nodes, per GPU (each GPU's own NIC), one direction."""

    name: str
    bytes_per_s: float
    latency_s: float
    source: str
    #: (bandwidth, latency) per collective where they were fitted apart, as ``Hardware.node_link_by_op``.
    by_op: dict[str, tuple[float, float]] = field(default_factory=dict)


HARDWARE: dict[str, Hardware] = {
    "h100-sxm": Hardware(
        name="h100-sxm",
        peak_flops={"bf16": 989.4e12, "fp8": 1978.9e12, "fp32": 494.7e12},
        memory_bytes=80e9,
        memory_bytes_per_s=3.35e12,
        gpus_per_node=8,
        node_link_bytes_per_s=450 * GB,
        node_link_latency_s=3e-6,
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM5: BF16 1,979, FP8 3,958 and TF32 989 TFLOPS with "
        "sparsity; 80 GB HBM3 at 3.35 TB/s; NVLink 900 GB/s); 8 GPUs per HGX node",
        nccl=True,
        nvls=True,
    ),
    "h200": Hardware(
        name="h200",
        peak_flops={"bf16": 989.4e12, "fp8": 1978.9e12, "fp32": 494.7e12},
        memory_bytes=141e9,
        memory_bytes_per_s=4.8e12,
        gpus_per_node=8,
        node_link_bytes_per_s=450 * GB,
        node_link_latency_s=3e-6,
        source="NVIDIA H200 Tensor Core GPU datasheet (SXM: the H100's tensor cores; 141 GB HBM3e at 4.8 TB/s; "
        "NVLink 900 GB/s); 8 GPUs per HGX node",
        nccl=True,
        nvls=True,
    ),
    "a100-sxm": Hardware(
        name="a100-sxm",
        peak_flops={"bf16": 312e12, "fp32": 156e12},
        memory_bytes=80e9,
        memory_bytes_per_s=2.039e12,
        gpus_per_node=8,
        node_link_bytes_per_s=300 * GB,
        node_link_latency_s=3e-6,
        source="NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB: BF16 312 and TF32 156 TFLOPS dense; HBM2e at "
        "2,039 GB/s; NVLink 600 GB/s); 8 GPUs per DGX A100",
        nccl=True,
    ),
}

NETWORKS: dict[str, Network] = {
    "ib-400g": Network(
        name="ib-400g",
        bytes_per_s=50 * GB,
        latency_s=5e-6,
        source="InfiniBand NDR, one 400 Gb/s ConnectX-7 NIC per GPU (DGX H100); torchtitan's Grand Teton "
        "hosts: 400 Gb/s RDMA per GPU",
    ),
    "roce-400g": Network(
        name="roce-400g",
        bytes_per_s=50 * GB,
        latency_s=5e-6,
        source="RoCE at 400 Gb/s per GPU: the Llama 3 paper's training clusters (Dubey et al. 2024, section 3.3.1)",
    ),
    "ib-200g": Network(
        name="ib-200g",
        bytes_per_s=25 * GB,
        latency_s=5e-6,
        source="InfiniBand HDR, 200 Gb/s per GPU: Selene's DGX A100 nodes, 8 HDR NICs each (Narayanan et al. 2021)",
    ),
}


def _named(kind: str, name: object, known: dict[str, object], example: str) -> object:
    if isinstance(name, str) and name in known:
        return known[name]
    close = difflib.get_close_matches(str(name), list(known), n=2)
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    raise ValueError(
        f"{kind} must be one of {', '.join(sorted(known))}{hint}, or a scale.{kind.capitalize()}; got {name!r}: "
        f"{example}"
    )


def hardware_named(hardware: str | Hardware) -> Hardware:
    """``hardware`` itself, or the profile of that name; one line naming the known ones otherwise."""
    if isinstance(hardware, Hardware):
        return hardware
    found = _named("hardware", hardware, dict(HARDWARE), 'scale.predict(plan, hardware="h100-sxm")')
    assert isinstance(found, Hardware)
    return found


def network_named(network: str | Network) -> Network:
    """``network`` itself, or the profile of that name; one line naming the known ones otherwise."""
    if isinstance(network, Network):
        return network
    found = _named("network", network, dict(NETWORKS), 'scale.predict(plan, network="ib-400g")')
    assert isinstance(found, Network)
    return found
