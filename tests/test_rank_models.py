"""One answer, for the watch and the checkpoint alike, to "what is the bare model?" and "is this ZeRO?".

Each case here is one where the watch's own answer and the checkpoint's used to differ.
"""

from __future__ import annotations

import torch
from _single_rank import single_rank_group
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab import checkpoint
from distlab.rank.models import is_zero_optimizer, unwrap
from distlab.telemetry import Watch, WatchConfig


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _layers_watched_and_saved(wrapped: torch.nn.Module, tmp_path) -> tuple[list[str], list[str]]:
    with Watch(wrapped, WatchConfig(publish=False)) as w:
        watched = list(w.layers.names)
    saved = checkpoint.read(checkpoint.save(tmp_path / "c.pt", model=wrapped, step=0))["model"]
    return watched, sorted({key.rsplit(".", 1)[0] for key in saved})


def test_a_compiled_model_is_watched_and_saved_under_the_bare_models_layer_names(tmp_path):
    bare = _model()
    compiled = torch.compile(bare)
    assert unwrap(compiled) is bare
    assert _layers_watched_and_saved(compiled, tmp_path) == (["0", "2"], ["0", "2"])


def test_a_data_parallel_model_is_watched_and_saved_under_the_bare_models_layer_names(tmp_path):
    bare = _model()
    assert unwrap(torch.nn.DataParallel(bare)) is bare
    assert _layers_watched_and_saved(torch.nn.DataParallel(bare), tmp_path) == (["0", "2"], ["0", "2"])


def test_ddp_around_a_compiled_model_unwraps_to_the_bare_model(tmp_path):
    bare = _model()
    with single_rank_group():
        wrapped = DDP(torch.compile(bare))
        assert unwrap(wrapped) is bare
        assert _layers_watched_and_saved(wrapped, tmp_path) == (["0", "2"], ["0", "2"])


def test_a_subclass_of_zero_is_zero_to_the_watch_and_to_the_checkpoint(tmp_path):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    class Sharded(ZeroRedundancyOptimizer):
        pass

    model = _model()
    with single_rank_group():
        opt = Sharded(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9)
        assert is_zero_optimizer(opt)
        with Watch(model, WatchConfig(publish=False)) as w:
            for _ in range(3):
                opt.zero_grad()
                model(torch.randn(5, 4)).square().mean().backward()
                opt.step()
        assert [r["step"] for r in w.records()] == [0, 1, 2]  # the inner optimizer's steps close none
        # Saved whole: the checkpoint consolidates it, as it does ZeroRedundancyOptimizer itself.
        path = checkpoint.save(tmp_path / "zero.pt", model=model, optimizer=opt, step=3)
    assert checkpoint.read(path)["optimizer"]["state"], "the momentum buffers were saved"


def test_an_optimizer_only_named_like_zero_is_not_zero():
    class ZeroRedundancyOptimizer(torch.optim.SGD):
        def consolidate_state_dict(self, to: int = 0) -> None:
            pass

    assert not is_zero_optimizer(ZeroRedundancyOptimizer(_model().parameters(), lr=0.1))
    assert not is_zero_optimizer(torch.optim.SGD(_model().parameters(), lr=0.1))
