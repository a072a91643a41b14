"""``scale.search``: the plans that fit a model on ``gpus`` GPUs, fastest first, each checked by a dry run.

    found = scale.search(model="llama3-70b", gpus=1024, hardware="h100-sxm", network="ib-400g")
    found.best.plan, found.best.prediction

It chooses as the field's guides tell a practitioner to (the Ultra-Scale Playbook's "step by step";
torchtitan's and Megatron-LM's performance guides): fit the memory first, keep tensor parallelism
inside a node, put pipeline stages across nodes, shard the rest with FSDP, and buy memory back with
activation checkpointing and smaller micro-batches only where they are needed.

1. **Lay out** every mesh of the allowed sizes: ``tp`` a power of two up to the node's GPUs that
   divides the heads, the KV heads and the MLP; ``pp`` a power of two up to the layers; FSDP over
   the rest (``dp = gpus / (tp * pp)``); each checkpointing mode; micro-batches of 1, 2 or 4
   sequences that divide the step's batch (at least ``pp`` of them under a pipeline, 1F1B).
2. **Screen** each layout with an estimate in closed form (:func:`estimate`): its memory per GPU
   (the model's states, sharded; under a pipeline the fp32 gradients held whole and the stage's
   parameters kept gathered, as the dry run finds torch's schedules do; the activations of the
   micro-batches in flight, counted as the blocks save them; the loss's logits) and its step time
   (6N plus attention's FLOPs at the predictor's efficiency, the recomputation, the bubble, tensor
   parallelism's all-reduces on the node's link).
   A layout whose estimate is over the GPU's memory by more than ``SLACK`` is dropped.
3. **Check** the layouts left, fastest estimate first, with ``scale.dry_run`` and ``scale.predict``
   (the real code's memory and collectives), until ``top`` of them fit or ``checks`` dry runs are
   spent. Each dry run corrects the estimate: a later layout with the same checkpointing is skipped
   when its estimate, times the most a dry run of that mode exceeded its own, is over the memory
   (on Llama 3 70B the estimate is 10-23% under the dry run). What is returned is ordered by the
   prediction, not by the estimate.

The estimate only orders the dry runs: a layout it places too low may go unchecked (``checks``
more to look further). Context parallelism, FP8, interleaved stages and HSDP are not searched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from html import escape
from typing import TYPE_CHECKING

from .. import checks as check
from ..errors import LabUsageError
from ..theory import bubble_fraction, in_flight_micro_batches
from .hardware import Hardware, Network, hardware_named, network_named
from .models import ModelConfig, parameters
from .plan import Plan, model_named
from .prediction import EFFICIENCY, Prediction, predict_report

if TYPE_CHECKING:
    from .report import DryRunReport

__all__ = ["SLACK", "Checked", "Estimate", "Search", "estimate", "layouts", "search"]

#: How far over the GPU's memory an estimate may be and its layout still be dry-run: the estimate
#: leaves out what the dry run finds (the allocator's view of each op's temporaries, FSDP's
#: all-gather buffers), and errs both ways by up to a fifth on the published rows.
SLACK = 1.25
_MICRO_BATCHES = (1, 2, 4)
_CHECKPOINTING = ("none", "selective", "full")


@dataclass(frozen=True)
class Estimate:
    """A layout's closed-form memory per GPU (bytes, its busiest stage) and step time (seconds)."""

    memory_bytes: float
    step_time_s: float


@dataclass(frozen=True)
class Checked:
    """A layout dry-run and predicted: what the search saw of it."""

    plan: Plan
    estimate: Estimate
    prediction: Prediction
    report: DryRunReport = field(repr=False)

    @property
    def fits(self) -> bool:
        return self.prediction.fits


@dataclass(frozen=True)
class Search:
    """What ``scale.search`` found: ``plans`` (those that fit, fastest predicted first), every layout
    ``checked`` by a dry run in the order it was, how many were laid out, screened out by their
    estimate, and skipped by the estimate as the dry runs corrected it."""

    model: str
    gpus: int
    hardware: str
    network: str
    plans: list[Checked]
    checked: list[Checked]
    laid_out: int
    screened_out: int
    corrected_out: int = 0

    @property
    def best(self) -> Checked:
        if not self.plans:
            raise LabUsageError(f"no plan of {self.model} on {self.gpus} GPUs fits the {self.hardware} in the "
                                f"{len(self.checked)} checked: give more GPUs, a smaller global batch, or checks=")
        return self.plans[0]

    def __str__(self) -> str:
        head = (f"{self.model} on {self.gpus} {self.hardware} GPUs + {self.network}: {self.laid_out} layouts, "
                f"{self.screened_out} over the memory by their estimate, {self.corrected_out} more once the dry "
                f"runs corrected it, {len(self.checked)} dry-run, "
                f"{len(self.plans)} fit")
        return "\n".join([head, *(f"  {_layout(c.plan)}: {_figures(c)}" for c in self.checked)])

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{escape(_layout(c.plan))}</td><td>{c.prediction.tokens_per_s_per_gpu:,.0f}</td>"
            f"<td>{100 * c.prediction.mfu:.1f}%</td><td>{c.prediction.memory_per_gpu_bytes / 2**30:.1f}</td>"
            f"<td>{'yes' if c.fits else 'no'}</td><td>{c.estimate.memory_bytes / 2**30:.1f}</td></tr>"
            for c in self.checked
        )
        return (f"<p>{escape(str(self).splitlines()[0])}</p><table><tr><th>plan</th><th>tokens/s per GPU</th>"
                "<th>MFU</th><th>GiB per GPU</th><th>fits</th><th>estimated GiB</th></tr>" + rows + "</table>")


def _layout(plan: Plan) -> str:
    return (f"tp {plan.tp} x pp {plan.pp} x fsdp {plan.gpus // (plan.tp * plan.pp)}, micro-batch "
            f"{plan.micro_batch_size}, checkpointing {plan.checkpointing}")


def _figures(c: Checked) -> str:
    p = c.prediction
    fits = "fits" if c.fits else "does not fit"
    return (f"{p.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, MFU {100 * p.mfu:.1f}%, "
            f"{p.memory_per_gpu_bytes / 2**30:.1f} GiB per GPU ({fits}; "
            f"estimated {c.estimate.memory_bytes / 2**30:.1f})")


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


def layouts(model: str | ModelConfig, gpus: int, hardware: Hardware, seq_len: int,
            global_batch_tokens: int) -> list[Plan]:
    """Every plan of step 1 (see the module) that ``Plan`` accepts."""
    cfg = model_named(model)
    found: list[Plan] = []
    for tp in _powers_of_two(min(hardware.gpus_per_node, gpus)):
        for pp in _powers_of_two(min(cfg.layers, gpus // tp)):
            if gpus % (tp * pp):
                continue
            dp = gpus // (tp * pp)
            for micro in _MICRO_BATCHES:
                count, left = divmod(global_batch_tokens, seq_len * micro * dp)
                if left or count < max(1, pp):
                    continue
                for mode in _CHECKPOINTING:
                    try:
                        found.append(Plan(model=model, gpus=gpus, tp=tp, pp=pp, seq_len=seq_len,
                                          global_batch_tokens=global_batch_tokens, micro_batch_size=micro,
                                          checkpointing=mode))
                    except LabUsageError:  # a split the model does not allow (heads, MLP, sequence)
                        continue
    return found


def _saved_per_token(cfg: ModelConfig, tp: int, sequence_parallel: bool, checkpointing: str) -> float:
    """The elements one block saves for its backward per token, as this package's blocks
    (``distlab.nn.llama``) under torch's tensor parallelism save them; Korthikanti et al. 2022 count
    GPT's with Megatron's sequence parallelism, which also splits what torch keeps whole.

    Without checkpointing: the norms' inputs (split by sequence parallelism), their outputs all-gathered
    whole for the weights' gradients, q, k and v, attention's output, and the MLP's inside (SwiGLU:
    w1's and w3's outputs, silu's, their product; GELU: fc's output and gelu's). Selective: what
    torchtitan's policy keeps, the matmuls' outputs (wo's and w2's whole before their reduction) and
    attention's. Full: the block's input."""
    d, f, kv = cfg.dim, cfg.ffn_dim, cfg.kv_heads * cfg.head_dim
    residual = d / (tp if sequence_parallel else 1)
    mlp_inside = (4 if cfg.architecture == "llama" else 2) * f / tp
    if checkpointing == "full":
        return residual
    if checkpointing == "selective":
        return (d + 2 * kv) / tp + d / tp + 2 * d + (mlp_inside / 2 if cfg.architecture == "llama" else f / tp)
    return 2 * residual + 2 * d + (d + 2 * kv) / tp + d / tp + mlp_inside


def estimate(plan: Plan, hardware: Hardware) -> Estimate:
    """Step 2 of the module: ``plan``'s memory per GPU on its first stage (the most micro-batches in
    flight) and its step time, in closed form."""
    cfg, tp, pp = plan.config, plan.tp, plan.pp
    dp = plan.gpus // (tp * pp)
    local = parameters(cfg) / (tp * pp)
    states = 16 * local / dp  # fp32 parameters and gradients, Adam's two fp32 moments, sharded over dp
    gathered = 2 * 2 * local / max(1, cfg.layers // pp)  # bf16 units: the one computing, the one prefetched
    if pp > 1:  # torch's schedules: the gradients whole in fp32, the parameters gathered through the step
        states += 4 * local - 4 * local / dp
        gathered = 2 * local
    tokens = plan.micro_batch_size * plan.seq_len * (2 if plan.precision == "bf16" else 4)  # bytes per element
    whole_layer = tokens * _saved_per_token(cfg, tp, plan.sequence_parallel_on, "none")
    layer = tokens * _saved_per_token(cfg, tp, plan.sequence_parallel_on, plan.checkpointing)
    in_flight = in_flight_micro_batches(0, pp, plan.micro_batches, plan.schedule) if pp > 1 else 1
    activations = layer * (cfg.layers // pp) * in_flight
    if plan.checkpointing != "none":  # the block run again in backward holds its whole activations
        activations += whole_layer
    logits = 16 * plan.micro_batch_size * plan.seq_len * cfg.vocab / tp  # bf16 and fp32 copies, log-softmax, grad
    memory = states + gathered + activations + (logits if pp == 1 else 0)
    flops = (6 * parameters(cfg) + 12 * cfg.layers * cfg.dim * plan.seq_len) * plan.global_batch_tokens / plan.gpus
    flops *= {"none": 1.0, "selective": 1.05, "full": 4 / 3}[plan.checkpointing]
    peak = hardware.peak_flops.get("bf16", max(hardware.peak_flops.values()))
    # every FLOP at the matmuls' rate: attention's and the memory-bound kernels' own rates are the dry
    # run's to count (scale.predict), which orders what this estimate screens
    rate = hardware.kernel_rates.matmul if hardware.kernel_rates is not None else 1.0
    compute = flops / (peak * rate * (hardware.efficiency or EFFICIENCY))
    # Megatron's two all-reduces a block forward and two backward, of the bf16 (micro-batch, seq, dim)
    # activation, each a ring's 2(t-1)/t of it on the node's link, for each micro-batch through the stage
    activation = plan.micro_batch_size * plan.seq_len * cfg.dim * 2
    per_micro_batch = 4 * (cfg.layers / pp) * 2 * (tp - 1) / tp * activation / hardware.node_link_bytes_per_s
    tp_time = plan.micro_batches * per_micro_batch
    step = (compute + tp_time) * (1 + (bubble_fraction(pp, plan.micro_batches, plan.schedule) if pp > 1 else 0))
    return Estimate(memory, step)


def search(
    model: str | ModelConfig,
    gpus: int,
    hardware: str | Hardware = "h100-sxm",
    network: str | Network = "ib-400g",
    *,
    seq_len: int = 8192,
    global_batch_tokens: int = 4 * 2**20,
    top: int = 3,
    checks: int = 6,
) -> Search:
    """The fastest plans of ``model`` on ``gpus`` GPUs that fit ``hardware``'s memory, each checked by
    a dry run (see the module). ``top``: stop once this many fit; ``checks``: the most dry runs."""
    gpus = check.whole("gpus", gpus, minimum=1, example="gpus=1024")
    seq_len = check.whole("seq_len", seq_len, minimum=1, example="seq_len=8192")
    global_batch_tokens = check.whole("global_batch_tokens", global_batch_tokens, minimum=1,
                                      example="global_batch_tokens=4 * 2**20")
    top = check.whole("top", top, minimum=1, example="top=3")
    checks_left = check.whole("checks", checks, minimum=1, example="checks=6")
    hw, net = hardware_named(hardware), network_named(network)
    cfg = model_named(model)
    from .dryrun_launcher import dry_run  # starts a process: imported where it is used

    laid = layouts(model, gpus, hw, seq_len, global_batch_tokens)
    if not laid:
        raise LabUsageError(f"no layout of {cfg.name} splits {global_batch_tokens:,} tokens of {seq_len} over {gpus} "
                            f"GPUs: give a global_batch_tokens that is a multiple of seq_len * {gpus}")
    estimated = [(plan, estimate(plan, hw)) for plan in laid]
    kept = sorted(((p, e) for p, e in estimated if e.memory_bytes <= SLACK * hw.memory_bytes),
                  key=lambda pe: pe[1].step_time_s)
    checked: list[Checked] = []
    corrected_out = 0
    learned: dict[str, float] = {}  # checkpointing mode -> the most a dry run's memory exceeded its estimate
    for plan, guess in kept:
        if checks_left == 0 or sum(c.fits for c in checked) >= top:
            break
        if guess.memory_bytes * learned.get(plan.checkpointing, 0.0) > hw.memory_bytes:
            corrected_out += 1  # over by its estimate as the dry runs of its kind corrected it
            continue
        report = dry_run(plan)
        found = Checked(plan, guess, predict_report(report, hw, net), report)
        checked.append(found)
        checks_left -= 1
        ratio = found.prediction.memory_per_gpu_bytes / guess.memory_bytes
        learned[plan.checkpointing] = max(learned.get(plan.checkpointing, 0.0), ratio)
    fitting = sorted((c for c in checked if c.fits), key=lambda c: -c.prediction.tokens_per_s_per_gpu)
    return Search(cfg.name, gpus, hw.name, net.name, fitting, checked, len(laid), len(laid) - len(kept), corrected_out)
