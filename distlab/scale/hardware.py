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
from dataclasses import dataclass, field, replace

__all__ = ["HARDWARE", "NETWORKS", "Hardware", "KernelRates", "Network", "hardware_named", "network_named"]

GB = 1e9


@dataclass(frozen=True)
class KernelRates:
    """The fraction of the part's peak that each kind of kernel reaches on its own, from published kernel
    benchmarks: a step's compute is each kind's work at its rate (``scale.predict``), so plans whose mix
    differs (long sequences: mostly attention; small micro-batches: mostly memory-bound kernels) are not
    all scaled by one number.

    ``matmul``: of the precision's peak, what a large GEMM reaches (the same fraction taken for fp8).
    ``attention``: of bf16's peak, what causal flash attention reaches, its FLOPs counted as its kernels
    count them, the causal half of the square (torch's count, the whole square, is halved for it).
    ``memory``: of the memory's bandwidth, what the memory-bound kernels (norms, activations, casts,
    residual adds) reach, one kernel an op as eager torch runs them or each chain of them between two
    matmuls fused (``Plan.fused_kernels``)."""

    matmul: float
    attention: float
    memory: float
    source: str


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
    #: What a step's compute reaches on this machine: with ``kernel_rates``, the fraction of those
    #: kernels' own time (what a framework loses between and around them: launches, waits, small
    #: kernels), fitted on a published run of this part (``efficiency_source`` says which); without, the
    #: fraction of the peak, as ``scale.calibrate`` measures a lab. None: the predictor's ``EFFICIENCY``.
    efficiency: float | None = None
    #: Where ``efficiency`` comes from, said beside every prediction that uses it.
    efficiency_source: str = ""
    #: Each kind of kernel's rate (None: every FLOP at the peak, as a lab's calibrated profile counts).
    kernel_rates: KernelRates | None = None
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
    #: The host's seconds for each op DTensor dispatches, beyond its local kernels (its sharding's
    #: propagation, redistributions, wrapping: Python), which a rank waits for where its host and its
    #: kernels take turns: a lab's CPU ranks (``scale.calibrate`` measures it). 0: a GPU's host queues
    #: kernels ahead of the device, and a step long enough to be worth predicting hides it.
    host_s_per_dtensor_op: float = 0.0


@dataclass(frozen=True)
class Network:
    """The network between nodes, per GPU (each GPU's own NIC), one direction."""

    name: str
    bytes_per_s: float
    latency_s: float
    source: str
    #: (bandwidth, latency) per collective where they were fitted apart, as ``Hardware.node_link_by_op``.
    by_op: dict[str, tuple[float, float]] = field(default_factory=dict)


_MAMF_H100 = ("matmul: 792.1 of 989 TFLOP/s, the Maximum Achievable Matmul FLOPS measured on an H100 SXM (Bekman, "
              "ml-engineering, compute/accelerator, CUDA 12.1), taken for fp8 too; memory-bound kernels at the "
              "datasheet's bandwidth")
#: NVIDIA's NeMo and Megatron runs: Transformer Engine's attention (cuDNN's):
#: 529 TFLOP/s forward (causal) and 518 backward (the paper's backward figure is not causal), head dim 128,
#: 8k tokens, on an H100 SXM5.
_H100_CUDNN = KernelRates(
    matmul=792.1 / 989.4, attention=523.5e12 / 989.4e12, memory=1.0,
    source=_MAMF_H100 + "; attention: cuDNN's, 529 TFLOP/s forward (causal) and 518 backward, head dim 128, "
    "8k tokens (Shah et al. 2024, FlashAttention-3, figures 5 and 6)",
)
#: torchtitan's runs: attention on torch's scaled_dot_product_attention, its flash backend (FlashAttention-2):
#: 333 TFLOP/s forward and 318 backward on the same shapes.
_H100_FA2 = KernelRates(
    matmul=792.1 / 989.4, attention=325.5e12 / 989.4e12, memory=1.0,
    source=_MAMF_H100 + "; attention: FlashAttention-2's (torch's flash backend), 333 TFLOP/s forward (causal) "
    "and 318 backward, head dim 128, 8k tokens (Shah et al. 2024, FlashAttention-3, figures 5 and 6)",
)
#: The efficiency of each H100 profile and the run it was fitted on (``benchmarks/bench_published_runs.py
#: --fit``: the efficiency at which the row's predicted tokens/s is the published one).
SXM_FIT = (0.8004, "fitted on NVIDIA's Megatron-Bridge 25.11 Llama 3 8B row (FP8, FSDP 8 on one DGX H100, "
                   "Transformer Engine: 14,451 tokens/s per GPU)")
TITAN_FIT = (0.6725, "fitted on torchtitan's Llama 3.1 8B FSDP 128 row (Dec 2024, Table 3, eager torch: 5,605 "
                     "tokens/s per GPU)")

_H100_SXM = Hardware(
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
    efficiency=SXM_FIT[0],
    efficiency_source=SXM_FIT[1],
    kernel_rates=_H100_CUDNN,
)

HARDWARE: dict[str, Hardware] = {
    "h100-sxm": _H100_SXM,
    # the same die, node and NVLink: what differs is said
    "h100-500w": replace(
        _H100_SXM,
        name="h100-500w",
        memory_bytes=96e9,
        memory_bytes_per_s=2.4e12,
        source="the H100s of torchtitan's published runs (benchmarks/llama3_h100_202412_torchtitan.md, Dec 2024): "
        "96 GB of HBM2e at 2.4 TB/s, the 500 W power limit, a peak 'between SXM and NVL' that torchtitan does "
        "not know and divides by the SXM's, as this profile does (its lower clock is in the fitted efficiency); "
        "Grand Teton hosts of 8 on NVLink",
        efficiency=TITAN_FIT[0],
        efficiency_source=TITAN_FIT[1],
        kernel_rates=_H100_FA2,
    ),
    # the H100 SXM's die, clock and 700 W: its kernels' rates and its fit (said as the H100's)
    "h200": replace(
        _H100_SXM,
        name="h200",
        memory_bytes=141e9,
        memory_bytes_per_s=4.8e12,
        source="NVIDIA H200 Tensor Core GPU datasheet (SXM: the H100's tensor cores; 141 GB HBM3e at 4.8 TB/s; "
        "NVLink 900 GB/s); 8 GPUs per HGX node",
        efficiency_source=SXM_FIT[1] + " (an H100 SXM: the same tensor cores, clock and power; not fitted on an H200)",
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
        kernel_rates=KernelRates(
            matmul=267.9 / 312, attention=0.6, memory=1.0,
            source="matmul: 267.9 of 312 TFLOP/s, the Maximum Achievable Matmul FLOPS measured on an A100 SXM "
            "(Bekman, ml-engineering, compute/accelerator, CUDA 12.1); attention: FlashAttention-2 on an A100, "
            "50-73% of the peak forward and backward (Dao 2023, figures 4-6), 0.6 taken",
        ),
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
