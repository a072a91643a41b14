"""Checkpoints that survive a crash, and resume bit for bit: ``distlab.checkpoint.save`` / ``load``.

A checkpoint holds what a training loop needs to continue as if it had never stopped:

    model        state dict of the bare model (DDP / torch.compile wrappers removed: no ``module.`` keys)
    optimizer    its state dict (a ZeroRedundancyOptimizer is consolidated onto rank 0 first)
    scheduler    an LR scheduler's state dict, if given
    step         optimizer steps already taken: the loop continues from there
    sampler      epoch (and seed, shuffle, drop_last, dataset length) of a DistributedSampler
    rng          every rank's RNG states: torch CPU, CUDA (if in use), python ``random``, numpy (if imported)
    extra        anything else the loop wants back, as plain data

``save`` is collective: every rank calls it with the same path and step. The ranks send their RNG
states to rank 0, rank 0 alone writes the file, and no rank returns before the file is complete:

    write to a hidden temporary file in the same directory -> flush -> fsync
    -> os.replace onto the final name -> fsync the directory

``os.replace`` is atomic, so a crash at any moment leaves either the previous checkpoint or the new
one at the path, never a torn file. A digest of the content is stored too, so a file damaged later
(or copied partially) is refused with a clear error instead of loading wrong numbers. Checkpoints
hold plain data only (tensors, numbers, strings, lists, tuples, dicts) and load with
``torch.load(..., weights_only=True)``, which never runs code from the file.

``load`` runs on each rank by itself (every rank reads the file; across hosts it must be on shared
storage). It checks that the model, optimizer and sampler fit before changing any of them. The world
size may differ from the one that saved: model, optimizer, step and epoch are restored everywhere; a
rank that existed at save time gets its own RNG states back, a new rank is re-seeded from
(step, rank), the same way every time. The data is re-sharded by the sampler you pass, built for
the current world (``DistributedSampler`` fixes ``num_replicas`` when it is made); ``load`` sets its
epoch and refuses one that would shuffle differently (another seed, dataset length, ...).

Resuming in the middle of an epoch: skip the batches already done in it
(``step - epoch * len(loader)`` at the same world size). Give the DataLoader its own generator
(``DataLoader(..., generator=torch.Generator())``): by default each ``iter(loader)`` draws a seed from
the global torch RNG, so the resumed run, which starts its epoch iterator once more, would draw
dropout masks from a different point of the stream than the run that saved. At another world size
the batches per epoch change and a position inside an epoch has no equivalent: for elastic runs,
save when an epoch ends, or run the saved epoch again from its start.

    from distlab import checkpoint
    last = checkpoint.latest("ckpts")
    step = checkpoint.load(last, model=model, optimizer=opt, sampler=sampler)["step"] if last else 0
    ...
    checkpoint.save(checkpoint.path_for("ckpts", step), model=model, optimizer=opt, step=step, sampler=sampler)

The package's modules, by what they hold; every public name is here (``checkpoint.save``, ...):

    saving      save: the ranks' RNG states gathered on rank 0, which writes; every rank waits for the file
    loading     read and load: the file checked, then what it is loaded into, before anything changes
    files       path_for and latest (the numbered names), the atomic write
    content     FORMAT, VERSION, CheckpointError, the plain-data rule for weights_only, the digest
    rng         every rank's RNG states, restored, or re-seeded for a rank that did not exist at save time
    _checks     the checks of save's and load's arguments
"""

from __future__ import annotations

from .content import FORMAT, VERSION, CheckpointError
from .files import latest, path_for
from .loading import load, read
from .saving import save

__all__ = [
    "FORMAT",
    "VERSION",
    "CheckpointError",
    "latest",
    "load",
    "path_for",
    "read",
    "save",
]
