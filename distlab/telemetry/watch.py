"""``distlab.watch(model)``: what one rank records about its training, step by step.

A step begins at the model's forward (with gradients enabled) and closes at the update: the
``step()`` of a torch optimizer holding the model's parameters or, for weights updated by hand
(in place, under ``torch.no_grad()``), the next forward. Forwards that find the weights unchanged
(gradient accumulation) continue the step; forwards without gradients (evaluation) are ignored.
When a step closes, its record is made: a :class:`distlab.records.StepRecord` (clock, loss, timed
all-reduce buckets of DDP, every other collective timed (FSDP2, tensor parallelism, by hand), the
rank's memory; per-layer norms every ``stats_every`` steps, replica checksums every
``checksum_every`` steps).

``distlab.log(loss=...)`` adds to the latest step, before or after its update, and so do the
collectives after the update (averaging the models every H steps); the record is final when the
next step begins. Everything a hook does is cheap except on sampled steps.

A compiled model is watched too: DDP's under ``torch.compile`` (its buckets), and the ops of any
other while it runs (the observer lets torch.compile compile). Watch the compiled module itself: a
hook on a module inside it runs inside the compiled call, which sets the observer aside (the first
step misses ops; the observer stays on after it).
"""

from __future__ import annotations

import itertools
import os
import time
import warnings
import weakref

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..rank import hooks, models, torchcompat, torchcompat_compile
from ..rank.publish import Publisher, Sender, rank_publisher
from ..records import PUBLISH_KEY, Layout, Publish, StepRecord, WatchMeta
from . import comm
from .comm import ReduceOpLike
from .observing import INSIDE_COMPILED, ObservedOps
from .parallelism import describe
from .record_buffer import RecordBuffer
from .stats import LayerIndex
from .step_memory import StepMemory
from .steps import Step, metric_fields, metric_value, wrapped_by_zero
from .watch_config import WatchConfig, make_config

__all__ = ["Watch", "active", "flush", "log", "watch"]

_active: list[Watch] = []
_runs = itertools.count()


def watch(model: torch.nn.Module, *, config: WatchConfig | None = None, **options: object) -> Watch:
    """Record this rank's training of ``model`` (DDP-wrapped or plain) and publish it to the notebook.

    Options are :class:`WatchConfig` fields, e.g. ``watch(model, stats_every=1)``. Use it as a
    context manager, or call ``close()``: either removes every hook. One watch per rank: a new one
    closes the previous (a re-run cell does not stack hooks).
    """
    settings = make_config(config, options)
    for previous in list(_active):
        previous.close()
    return Watch(model, settings, rank_publisher() if settings.publish else None)


def log(**values: object) -> None:
    """Attach values to the current step of the open watch: ``distlab.log(loss=loss, epoch=e)``.

    ``loss`` and ``epoch`` have their own fields; anything else goes to ``metrics``. Tensors are
    read with ``.item()``. Without an open watch this does nothing, so a loop can keep its logging
    when it is not watched.
    """
    if _active:
        _active[-1].log(**values)


def active() -> Watch | None:
    """The open watch on this rank, if any."""
    return _active[-1] if _active else None


@hooks.at_cell_end  # rank/cell.py calls it when a cell ends
def flush() -> None:
    """Publish all that every open watch on this rank has recorded, now.

    distlab calls it when a ``%%ddp`` cell ends, so a watch left open (no ``with``, no ``close()``)
    still shows its last steps in the notebook; the watch stays open for the next cell.
    """
    for open_watch in _active:  # flushing closes nothing: _active does not change
        open_watch.flush()


class Watch:
    """One rank's telemetry of one model. Made by :func:`watch`; see the module docstring."""

    def __init__(self, model: torch.nn.Module, config: WatchConfig, sender: Publisher | Sender | None = None) -> None:
        """``sender``: the rank's publisher (:func:`watch` passes it), or a ``publish_data`` of its own (tests)."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"watch() takes a torch.nn.Module (or a DDP-wrapped one), got {type(model).__name__}")
        self.config = config
        self.model = model
        self._ddp = models.ddp_of(model)  # a DDP model itself, or under torch.compile's wrapper
        self.is_ddp = self._ddp is not None
        self.layers = LayerIndex(models.unwrap(model))  # layers named as the bare model names them
        up = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if up else 0
        self.world_size = dist.get_world_size() if up else 1
        self.run_id = f"{os.getpid()}:{next(_runs)}"
        self.notes: list[str] = []
        self.closed = False

        self._records = RecordBuffer(config.buffer_steps, config.window_steps)  # what the publisher reads
        self._seq = 0
        self._open: Step | None = None
        self._last_end: float | None = None
        self._owns_cache: weakref.WeakKeyDictionary[torch.optim.Optimizer, bool] = weakref.WeakKeyDictionary()
        self._param_ids = {id(p) for p in self.layers.params}

        self.initial_checksums = self._replica_checksums()
        self._snapshot = self.layers.snapshot() if config.stats_every else None  # for step 0's update

        self._timer: comm.CommTimer | None = None
        if config.time_allreduce:
            self._timer, why = comm.attach(self._ddp or model)
            if why:
                self.notes.append(why)
        self._layout: Layout | None = None
        self._cuda = next((p.device for p in self.layers.params if p.is_cuda), None)
        # DDP's buckets are timed by its reducer's stand-in group (comm); every other model's
        # collectives op by op. Memory on CUDA comes from the allocator, on the CPU from the ops.
        time_ops = config.time_allreduce and not self.is_ddp
        self._ops = ObservedOps(time_ops, count_storages=config.track_memory and self._cuda is None)
        self._step_memory = StepMemory(self.layers.params, self._cuda, self._ops.live)
        self._handles = [
            # Not traced by torch.compile: a hook on a module inside a compiled one runs in the
            # compiled frame, and tracing it (clock, lock, dispatch mode) broke the graph at each call.
            model.register_forward_pre_hook(torchcompat_compile.not_compiled(self._on_forward), prepend=True),
            register_optimizer_step_post_hook(self._on_optimizer_step),
        ]
        publisher = sender if isinstance(sender, Publisher) or sender is None else Publisher(sender)
        self._own_publisher = publisher if publisher is not sender else None  # stopped with this watch
        # keep_final: a cell's end that cannot send the whole buffer at once is owed it, sent later.
        self._publisher = (publisher.source(PUBLISH_KEY, self._payload, config.publish_interval_s, keep_final=True)
                           if publisher is not None else None)
        if self._timer is not None:
            self._timer.timings = []
            self._timer.enabled = True
        _active.append(self)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Remove every hook (and give DDP's reducer its own group back), finish the last step, publish it all."""
        if self.closed:
            return
        self.closed = True
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._timer is not None:
            comm.detach(self._ddp or self.model, self._timer)
        step = self._open
        if step is not None:
            if step.record is None and self._weights_version() != step.version:
                self._close(step)  # weights updated by hand: the last step ends here
            if step.record is not None:
                self._finish(step)
        self._open = None
        self._resolve(wait=True)
        self._snapshot = None
        self._ops.stop(self.notes)
        if self in _active:
            _active.remove(self)
        if self._publisher is not None:
            self._publisher.close()
            if self._own_publisher is not None:
                self._own_publisher.close()
            if self._publisher.error:
                self.notes.append(f"publishing stopped: {self._publisher.error}")

    def flush(self) -> None:
        """Publish every step recorded so far, now (see :func:`flush`).

        At a cell's end: ops are no longer observed until the next step begins, so a cell that
        failed mid-step leaves no observer on the rank.
        """
        self._ops.stop(self.notes)
        if self._open is not None:
            self._take_late(self._open)
        self._resolve(wait=True)
        if not self.closed and self._publisher is not None:
            self._publisher.flush()

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        steps = len(self._records)
        return f"<Watch {state}: rank {self.rank}, {len(self.layers.names)} layers, {steps} steps recorded>"

    # ------------------------------------------------------------------ what it recorded

    def records(self) -> list[StepRecord]:
        """This rank's records, oldest first (the last ``buffer_steps`` steps)."""
        self._resolve(wait=True)
        return self._records.all()

    @property
    def publishes(self) -> int:
        """How many times this watch has published to the notebook so far."""
        return self._publisher.sent if self._publisher is not None else 0

    def meta(self) -> WatchMeta:
        """What the notebook needs besides the steps: layers, sizes, the checksums at the start."""
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "run": self.run_id,
            "ddp": self.is_ddp,
            "layers": list(self.layers.names),
            "sharded_layers": list(self.layers.sharded),
            "replicated": self.config.replicated,
            "grad_bytes": self.layers.grad_bytes,
            "initial_checksums": dict(self.initial_checksums),
            "timed": self._timer is not None or self._ops.timed,
            "memory": (
                None if not self.config.track_memory else ("cuda" if self._cuda is not None else "cpu: live tensors")
            ),
            "layout": self._layout,
            "config": {
                "stats_every": self.config.stats_every,
                "checksum_every": self.config.checksum_every,
                "publish_interval_s": self.config.publish_interval_s,
            },
            "notes": list(self.notes),
            "closed": self.closed,
        }

    def _payload(self, final: bool) -> Publish:
        """What one publish carries: the steps since the one before last (all of them when final)."""
        window = self._records.window(final)
        self._seq += 1
        return {"run": self.run_id, "rank": self.rank, "seq": self._seq, "final": final,
                "meta": self.meta(), "records": window}

    # ------------------------------------------------------------------ hooks

    def _on_forward(self, module: torch.nn.Module, args: tuple[object, ...]) -> None:
        if not torch.is_grad_enabled():
            return  # evaluation forwards are not training steps
        step = self._open
        if step is None:
            if self._ops.observer is not None and torchcompat_compile.inside_compiled_call():
                self._note(INSIDE_COMPILED)
            self._begin(0, None)
            return
        if step.record is None:
            if self._weights_version() == step.version:
                return  # no update since the step began (gradient accumulation): the step goes on
            self._close(step)  # weights updated by hand: this forward ends the previous step
        self._finish(step)
        self._begin(step.number + 1, time.perf_counter() - self._last_end if self._last_end is not None else None)

    def _on_optimizer_step(
        self, optimizer: torch.optim.Optimizer, args: tuple[object, ...], kwargs: dict[str, object]
    ) -> None:
        if not self._owns(optimizer):
            return
        optimizers = self._step_memory.optimizers
        if optimizer not in optimizers:
            optimizers.add(optimizer)
            # Read now: the optimizer may be gone by the time the watch publishes its last steps.
            self._layout = describe(self.model, self.layers.params, list(optimizers), self.world_size) \
                if self.config.replicated else None
        step = self._open
        if step is not None and step.record is None:
            self._close(step)

    def _note(self, text: str) -> None:
        """Say it once: in the watch's notes, and as a warning on the rank (its cell streams it)."""
        if text not in self.notes:
            self.notes.append(text)
            warnings.warn(f"distlab.watch: {text}", stacklevel=4)

    def _owns(self, optimizer: torch.optim.Optimizer) -> bool:
        owns = self._owns_cache.get(optimizer)
        if owns is None:
            owns = not wrapped_by_zero(optimizer) and any(
                id(p) in self._param_ids for group in optimizer.param_groups for p in group["params"]
            )
            self._owns_cache[optimizer] = owns
        return owns

    # ------------------------------------------------------------------ steps

    def _weights_version(self) -> int:
        # Every in-place change of a tensor bumps its version counter: an optimizer's step does,
        # and so does ``p -= lr * p.grad`` under no_grad. Gradient accumulation does not.
        return sum(torchcompat.version_counter(p) for p in self.layers.params)

    def _begin(self, number: int, gap_s: float | None) -> None:
        self._resolve(wait=False)
        step = Step(number, gap_s, self._weights_version())
        self._open = step
        if self._timer is not None:
            self._timer.timings = step.timings
        if self.config.track_memory:
            self._step_memory.begin(step)
        self._ops.begin(step)

    def _close(self, step: Step) -> None:
        """The update is done: measure the step and make its record.

        Ops stay observed: collectives after the update (averaging the models every H steps, an
        outer optimizer's step) belong to this step, added to its record when the next one begins."""
        end = time.perf_counter()
        self._last_end = end
        n, cfg = step.number, self.config
        # On a GPU, CUDA events and logged tensors are read once the GPU got there (telemetry/pending.py).
        deferred = self._cuda is not None
        memory = self._step_memory.record(step) if cfg.track_memory else None
        record = step.new_record(self.rank, self.world_size, end, memory, timed=not deferred)
        if cfg.stats_every and n % cfg.stats_every == 0:
            record["grad_norm"] = self.layers.grad_norms()
            record["weight_norm"] = self.layers.weight_norms()
            if self._snapshot is not None:
                record["update_ratio"] = self.layers.update_ratios(self._snapshot)
            self._snapshot = None
        if cfg.stats_every and (n + 1) % cfg.stats_every == 0:
            self._snapshot = self.layers.snapshot()  # the next step is sampled: keep its starting weights
        if cfg.checksum_every and n % cfg.checksum_every == 0:
            sums = self._replica_checksums()
            record["layer_checksums"] = sums
            record["checksum"] = sum(sums.values()) if sums else None
        if deferred:
            self._records.pending.add(step)
        else:
            record.update(metric_fields(step.metrics))  # type: ignore[typeddict-item]  # its MetricFields part
        step.record = record
        step.closed_with = len(step.collectives)
        self._records.closed(record, waits_for_gpu=deferred)
        if self._publisher is not None and not deferred:
            self._publisher.notify()

    def _resolve(self, wait: bool) -> None:
        """Complete the records of GPU steps the GPU has finished (``wait``: of every one, waiting)."""
        if self._records.pending.resolve(wait, self.world_size, self._records.replace) and self._publisher is not None:
            self._publisher.notify()

    def _replica_checksums(self) -> dict[str, int]:
        """Checksums of the layers every rank holds whole: a sharded layer's shards differ by design."""
        sums = self.layers.checksums()
        if not self.layers.sharded:
            return sums
        return {name: value for name, value in sums.items() if name not in self.layers.sharded}

    def _take_late(self, step: Step) -> None:
        """Add the collectives that came after a closed step's update to its record."""
        record = step.record
        if record is None or self._records.waits_for_gpu(record) or len(step.collectives) == step.closed_with:
            return  # a GPU step's record waiting for the GPU takes them all when it is completed
        step.closed_with = len(step.collectives)
        collectives = comm.summarize_collectives(step.collectives, step.begin, step.end)[0]
        self._records.amend(step, {"collectives": collectives})

    def _finish(self, step: Step) -> None:
        """The record is final: keep it in the buffer."""
        if step.record is None:
            return
        self._take_late(step)
        self._records.keep(step.record)

    def log(self, **values: object) -> None:
        """See :func:`distlab.log`."""
        if self.closed:
            return
        if self._open is None:
            self._begin(0, None)
        step = self._open
        assert step is not None
        step.metrics.update({k: metric_value(k, v) for k, v in values.items()})
        if step.record is not None and step not in self._records.pending:  # else _resolve adds them
            self._records.amend(step, metric_fields(step.metrics))
            if self._publisher is not None:
                self._publisher.notify()

    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOpLike | None = None, group: dist.ProcessGroup | None = None
    ) -> torch.Tensor:
        """``dist.all_reduce(tensor)``, timed as a bucket of this step: for gradients averaged by hand."""
        if self._open is None:
            self._begin(0, None)
        step = self._open
        assert step is not None
        return comm.timed_all_reduce(step.timings, self._ops.observer, tensor, op, group)

