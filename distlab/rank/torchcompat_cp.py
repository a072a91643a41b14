"""torch's context parallelism (``torch.distributed.tensor.experimental.context_parallel``) on CPU too.

torch's context parallelism shards a batch's sequence over a ``cp`` mesh dimension (load-balanced: rank
r of n holds chunks r and 2n-1-r of 2n, so every rank does the same causal work) and replaces SDPA by
ring attention: each rank's queries meet every rank's keys and values, passed round the ring by
all-to-all ("alltoall", the ring) or gathered at once ("allgather", the form Llama 3 trained with),
the partial results merged by their log-sum-exp. Backward passes the keys' and values' gradients back
round the ring.

torch dispatches ring attention for the GPU's attention kernels (flash, memory-efficient, cuDNN) only:
on CPU, ``scaled_dot_product_attention`` runs ``aten._scaled_dot_product_flash_attention_for_cpu``,
which torch's table lacks, so a CPU rank (a dry run's fake rank, a gloo lab's rank) would fail. This
module adds that op and its backward to the same table, calling torch's own ring
(``_templated_ring_attention`` and its backward, which take the attention op as an argument: the CPU
op has the GPU flash op's arguments and returns its first two results, the output and the log-sum-exp).

``rank/torchcompat.py``'s rule holds: the private names are used here and nowhere else. No public API
registers an attention op for context parallelism.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import context_parallel as torch_context_parallel

from . import torchcompat_release  # noqa: F401 - checks the torch release before anything here is used

__all__ = ["ROTATIONS", "context_parallel", "flatten"]

#: How keys and values travel between the cp ranks: torch's two ring rotations.
ROTATIONS = ("alltoall", "allgather")

_aten = torch.ops.aten


def _local(value: object) -> torch.Tensor:
    if isinstance(value, DTensor):
        return value.to_local()
    assert isinstance(value, torch.Tensor), f"ring attention takes tensors, got {type(value).__name__}"
    return value


def _wrap(local: torch.Tensor, like: DTensor) -> DTensor:
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False)


def _ring_forward(op: object, args: Sequence[object], kwargs: dict[str, object]) -> tuple[DTensor, DTensor]:
    from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention

    query = args[0]
    assert isinstance(query, DTensor)
    q, k, v = _local(args[0]), _local(args[1]), _local(args[2])
    dropout_p = args[3] if len(args) > 3 else kwargs.get("dropout_p", 0.0)
    is_causal = args[4] if len(args) > 4 else kwargs.get("is_causal", False)
    if kwargs.get("attn_mask") is not None:
        raise NotImplementedError("context parallelism takes causal attention without a mask")
    out, lse = _templated_ring_attention(
        query.device_mesh.get_group(), 2, _aten._scaled_dot_product_flash_attention_for_cpu.default,
        query=q, key=k, value=v, is_causal=bool(is_causal), dropout_p=dropout_p, scale=kwargs.get("scale"),
    )
    return _wrap(out, query), _wrap(lse, query)


def _ring_backward(op: object, args: Sequence[object], kwargs: dict[str, object]) -> tuple[DTensor, ...]:
    from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention_backward

    names = ("grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal")
    given = {**dict(zip(names, args)), **kwargs}
    query = given["query"]
    assert isinstance(query, DTensor)
    grad_out, q, k, v, out, lse = (_local(given[name]) for name in names[:6])
    grads = _templated_ring_attention_backward(
        query.device_mesh.get_group(), 2, _aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        grad_out=grad_out, grad_out_name="grad_out", query=q, key=k, value=v, out=out, logsumexp=lse,
        is_causal=bool(given.get("is_causal", False)), dropout_p=given.get("dropout_p", 0.0), scale=given.get("scale"),
    )
    return tuple(_wrap(g, query) for g in grads[:3])


_CPU_HANDLERS = {
    _aten._scaled_dot_product_flash_attention_for_cpu.default: _ring_forward,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _ring_backward,
}


def flatten(mesh: DeviceMesh, dims: tuple[str, ...], name: str) -> DeviceMesh:
    """``mesh``'s adjacent dimensions ``dims`` as one, named ``name`` (and then reachable as
    ``mesh[name]``): ``DeviceMesh._flatten``, which torchtitan uses to shard FSDP over its data-parallel
    and context-parallel ranks at once ("dp_shard_cp": the cp ranks hold the same weights, so their
    gradients are reduced together). torch offers no public way to join two dimensions of a mesh."""
    return mesh[dims]._flatten(name)


@contextmanager
def context_parallel(
    mesh: DeviceMesh, buffers: list[torch.Tensor], seq_dims: list[int], rotate: str = "alltoall"
) -> Iterator[None]:
    """Inside: ``buffers`` (token ids, targets: whatever has a sequence dimension) hold this rank's
    load-balanced share of the sequence, and SDPA is ring attention over ``mesh`` (one dimension, the
    cp ranks), on CPU as on GPU. Forward and backward must both run inside. ``rotate``: ``ROTATIONS``.
    The buffers keep their shards after (the step that needs them is over)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    if rotate not in ROTATIONS:
        raise ValueError(f"rotate={rotate!r}: use one of {', '.join(ROTATIONS)}")
    dispatcher = DTensor._op_dispatcher
    old_rotation = _attention._cp_options.rotate_method
    _attention.set_rotate_method(rotate)
    try:
        with torch_context_parallel(mesh, buffers=buffers, buffer_seq_dims=seq_dims,
                                    no_restore_buffers=set(buffers)):
            # torch installed its handlers as a new table on entering; it puts back its own on leaving
            dispatcher._custom_op_handlers = {**dispatcher._custom_op_handlers, **_CPU_HANDLERS}
            yield
    finally:
        _attention._cp_options.rotate_method = old_rotation
