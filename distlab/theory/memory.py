"""Memory of training: bytes per parameter (weights, gradients, optimizer states) in fp32 and in the
two mixed-precision layouts, what one device holds under plain DDP or ZeRO stage 1-3, and the size of
an activation."""

from __future__ import annotations

from dataclasses import dataclass

from .. import checks
from ._checks import checked_count, checked_non_negative

# --------------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------------

_PRECISIONS = ("fp32", "mixed", "autocast")
_OPTIMIZERS = ("adam", "momentum", "sgd")


@dataclass(frozen=True)
class StateBytes:
    """Bytes each parameter costs in training, split the way ZeRO shards them."""

    weights: int
    gradients: int
    optimizer_states: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer_states


def state_bytes_per_parameter(precision: str = "mixed", optimizer: str = "adam") -> StateBytes:
    """Weights, gradients and optimizer states per parameter.

    ``precision`` names the layout of the model states:

    * ``"mixed"``, the ZeRO paper's mixed-precision layout (Rajbhandari et al. 2020): fp16 weights (2)
      and gradients (2), and an fp32 master copy (4) that the optimizer owns, so it counts with the
      optimizer states. Megatron-LM keeps fp32 gradients when it trains in bf16 (2 + 4 + 12 = 18 bytes
      with Adam, its distributed-optimizer guide), a layout not modelled here;
    * ``"autocast"``, what ``torch.autocast`` keeps: fp32 weights (4) and gradients (4), no master copy.
      The matrix multiplies run in 16 bits on casts made during the forward; the stored states are
      those of fp32 training;
    * ``"fp32"``: 4 and 4, no master copy.

    ``optimizer``: "adam" keeps m and v (4 + 4, fp32), "momentum" (SGD with momentum) one buffer (4),
    "sgd" none. Mixed-precision Adam is 16 bytes either way: 2 + 2 + (4 + 4 + 4) or 4 + 4 + (4 + 4).
    """
    checks.choice("precision", precision, _PRECISIONS)
    checks.choice("optimizer", optimizer, _OPTIMIZERS)
    moments = {"adam": 8, "momentum": 4, "sgd": 0}[optimizer]
    if precision == "mixed":
        return StateBytes(weights=2, gradients=2, optimizer_states=4 + moments)
    return StateBytes(weights=4, gradients=4, optimizer_states=moments)  # fp32, and autocast's layout


def bytes_per_parameter(precision: str = "mixed", optimizer: str = "adam") -> int:
    """Total training bytes per parameter: 16 for mixed-precision Adam, 2 + 2 + 4 + 4 + 4 in the ZeRO
    paper's layout (``"mixed"``) and 4 + 4 + 4 + 4 under ``torch.autocast`` (``"autocast"``)."""
    return state_bytes_per_parameter(precision, optimizer).total


@dataclass(frozen=True)
class MemoryBreakdown:
    """Memory one device needs, in bytes."""

    weights_bytes: float
    gradients_bytes: float
    optimizer_states_bytes: float
    activation_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.weights_bytes + self.gradients_bytes + self.optimizer_states_bytes + self.activation_bytes


def memory_breakdown(
    parameters: float,
    devices: int = 1,
    zero_stage: int = 0,
    precision: str = "mixed",
    optimizer: str = "adam",
    activation_bytes: float = 0.0,
) -> MemoryBreakdown:
    """Per-device memory of data-parallel training, plain DDP (``zero_stage=0``) or ZeRO stage 1-3.

    Stage 1 shards optimizer states over ``devices``, stage 2 gradients too, stage 3 (FSDP) the weights
    too. ``activation_bytes`` (activations and buffers of one device) are not sharded.
    """
    count = checked_non_negative("parameters", parameters)
    shards = checked_count("devices", devices)
    stage = checked_count("zero_stage", zero_stage, minimum=0)
    if stage > 3:
        raise ValueError(f"zero_stage must be 0 (plain DDP), 1, 2 or 3, got {zero_stage!r}")
    per = state_bytes_per_parameter(precision, optimizer)

    def share(bytes_each: int, sharded_from_stage: int) -> float:
        total = count * bytes_each
        return total / shards if stage >= sharded_from_stage else total

    return MemoryBreakdown(
        weights_bytes=share(per.weights, 3),
        gradients_bytes=share(per.gradients, 2),
        optimizer_states_bytes=share(per.optimizer_states, 1),
        activation_bytes=checked_non_negative("activation_bytes", activation_bytes),
    )


def memory_per_device_bytes(
    parameters: float,
    devices: int = 1,
    zero_stage: int = 0,
    precision: str = "mixed",
    optimizer: str = "adam",
    activation_bytes: float = 0.0,
) -> float:
    """Total of :func:`memory_breakdown`: 2e9 parameters, mixed Adam -> 32 GB; ZeRO-3 over 8 -> 4 GB."""
    return memory_breakdown(parameters, devices, zero_stage, precision, optimizer, activation_bytes).total_bytes


def activation_bytes(micro_batch: int, sequence_length: int, hidden_size: int, bytes_per_element: int = 2) -> int:
    """Bytes of one [micro_batch, sequence_length, hidden_size] activation, the tensor a pipeline stage
    sends to the next (forward) and gets back as a gradient (backward)."""
    return (
        checked_count("micro_batch", micro_batch)
        * checked_count("sequence_length", sequence_length)
        * checked_count("hidden_size", hidden_size)
        * checked_count("bytes_per_element", bytes_per_element)
    )
