"""distlab.nn: the labs' text, tokenizer and batches, the GPT, how it splits, and the peak matmul rate.

The fast tier checks one process; the cluster tier checks the splits on a real 2-rank lab against the
same model trained in one process here: tensor (and sequence) parallel gradients, FSDP2's, and a
pipeline schedule's loss and gradients.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distlab import theory
from distlab.nn import (
    GPT,
    CharTokenizer,
    GPTConfig,
    corpus,
    peak_matmul_flops_per_s,
    pipeline_stages,
    tensor_parallel_plan,
    token_batches,
)
from distlab.nn.gpt import Attention
from distlab.nn.text import ALPHABET

SMALL = {"vocab_size": 20, "seq_len": 16, "layers": 4, "hidden": 32, "heads": 4}


@pytest.fixture(scope="module")
def text() -> str:
    return corpus()


@pytest.fixture(scope="module")
def tokens(text: str) -> torch.Tensor:
    return CharTokenizer(text).encode(text)


def _ids(batch: int = 4, seq: int = 16, vocab: int = 20, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _model(**overrides: object) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**SMALL, **overrides}))  # type: ignore[arg-type]


# --- text --------------------------------------------------------------------------------------------


def test_the_corpus_is_the_same_long_english_text_every_time(text):
    assert corpus() == text
    assert len(text) > 100_000
    assert "statement" in text and "expression" in text


def test_the_corpus_has_the_same_characters_on_every_python(text):
    # Python's own topics differ between releases (3.12 has "$", 3.10 "`"): kept to the alphabet,
    # the vocabulary, and so every model's size a notebook prints, is the same on each.
    assert set(text) == ALPHABET and len(ALPHABET) == 103


def test_the_tokenizer_numbers_the_sorted_characters_and_round_trips_the_corpus(text, tokens):
    tok = CharTokenizer(text)
    assert tok.vocab_size == len(set(text))
    assert tok.chars == sorted(tok.chars)
    assert torch.equal(tok.encode("".join(tok.chars)), torch.arange(tok.vocab_size))
    assert tokens.dtype == torch.long and tokens.shape == (len(text),)
    assert tok.decode(tokens) == text
    assert tok.decode(tokens[:50].tolist()) == text[:50]


def test_a_character_outside_the_vocabulary_is_named():
    with pytest.raises(ValueError, match="'z' is not in this tokenizer's vocabulary"):
        CharTokenizer("abc").encode("abz")


# Token i is the number i: a row of a batch names the window it came from.
NUMBERED = torch.arange(1_001)


def test_targets_are_the_inputs_shifted_by_one_token_from_a_window_of_the_tokens():
    inputs, targets = token_batches(NUMBERED, batch_size=4, seq_len=10)[3]
    assert inputs.shape == targets.shape == (4, 10) and inputs.dtype == torch.long
    for row, target in zip(inputs, targets):
        start = int(row[0])
        assert start % 10 == 0, "windows start at multiples of seq_len, so they never overlap"
        assert torch.equal(row, torch.arange(start, start + 10))
        assert torch.equal(target, row + 1)


def test_data_parallel_ranks_read_disjoint_windows_that_together_are_the_one_rank_batch():
    one = token_batches(NUMBERED, batch_size=8, seq_len=10, seed=3)
    ranks = [token_batches(NUMBERED, batch_size=4, seq_len=10, rank=r, world_size=2, seed=3) for r in (0, 1)]
    assert ranks[0].steps_per_epoch == one.steps_per_epoch == 100 // 8
    seen: list[int] = []
    for step in range(one.steps_per_epoch):
        both = torch.cat([r[step][0] for r in ranks])
        assert torch.equal(both, one[step][0])
        seen += both[:, 0].tolist()
    # In an epoch every window is read once, by one rank.
    assert len(set(seen)) == len(seen) == 100 // 8 * 8


def test_batches_are_fixed_by_the_seed_and_the_same_for_every_reader_at_world_size_one(tokens):
    a = token_batches(tokens, batch_size=2, seq_len=16, seed=5)
    b = token_batches(tokens, batch_size=2, seq_len=16, seed=5)
    other = token_batches(tokens, batch_size=2, seq_len=16, seed=6)
    assert all(torch.equal(a[s][0], b[s][0]) for s in (0, 1, 500))
    assert not torch.equal(a[0][0], other[0][0])
    iterated = [x for _, (x, _) in zip(range(3), a)]
    assert all(torch.equal(x, a[s][0]) for s, x in enumerate(iterated))


def test_batches_are_made_on_the_device_asked_and_are_the_same_there():
    # The meta device holds no data but does place and shape-check every op, as a GPU would.
    on_cpu = token_batches(NUMBERED, batch_size=4, seq_len=10, rank=1, world_size=2, seed=3)
    on_meta = token_batches(NUMBERED, batch_size=4, seq_len=10, rank=1, world_size=2, seed=3, device="meta")
    assert on_cpu[2][0].device.type == "cpu" and on_cpu.device == torch.device("cpu")
    x, y = on_meta[2]
    assert (x.device.type, y.device.type) == ("meta", "meta") and x.shape == on_cpu[2][0].shape
    assert "device='meta'" in repr(on_meta)
    moved = token_batches(NUMBERED, batch_size=4, seq_len=10, device=torch.device("cpu"))
    assert torch.equal(moved[5][1], token_batches(NUMBERED, batch_size=4, seq_len=10)[5][1])


def test_a_new_epoch_visits_the_windows_in_a_new_order(tokens):
    batches = token_batches(NUMBERED, batch_size=4, seq_len=10)
    per_epoch = batches.steps_per_epoch
    assert not torch.equal(batches[0][0], batches[per_epoch][0])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 0, "seq_len": 8}, "batch_size must be >= 1"),
        ({"batch_size": 2, "seq_len": 8, "rank": 2, "world_size": 2}, "rank must be below world_size=2"),
        ({"batch_size": 2, "seq_len": 8, "world_size": 0}, "world_size must be >= 1"),
        ({"batch_size": 600, "seq_len": 8}, "fewer than one global batch"),
        ({"batch_size": 2, "seq_len": 8, "device": "gpu0"}, "device must name a torch device"),
    ],
)
def test_bad_batch_arguments_are_one_clear_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        token_batches(torch.zeros(1000, dtype=torch.long), **kwargs)


# --- the model ---------------------------------------------------------------------------------------


def test_the_model_gives_logits_and_the_mean_cross_entropy():
    model = _model()
    idx, targets = _ids(), _ids(seed=2)
    logits = model(idx)
    assert logits.shape == (4, 16, 20)
    again, loss = model(idx, targets)
    assert torch.equal(logits, again)
    torch.testing.assert_close(loss, F.cross_entropy(logits.reshape(-1, 20), targets.reshape(-1)))


def test_a_position_sees_no_later_token():
    model = _model()
    idx = _ids()
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 20
    before, after = model(idx), model(changed)
    torch.testing.assert_close(before[:, :10], after[:, :10])
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_the_layout_is_gpt2s_with_the_names_the_labs_use():
    model = _model(layers=2, ffn_hidden=48)
    assert isinstance(model.blocks, nn.ModuleList) and len(model.blocks) == 2
    block = model.blocks[0]
    assert [name for name, _ in block.named_children()] == ["ln1", "attn", "ln2", "mlp"]
    assert {name for name, _ in block.attn.named_children()} >= {"q", "k", "v", "out"}
    assert (block.mlp.fc.in_features, block.mlp.fc.out_features) == (32, 48)
    assert (block.mlp.proj.in_features, block.mlp.proj.out_features) == (48, 32)
    assert model.tok.num_embeddings == 20 and model.pos.num_embeddings == 16
    assert isinstance(model.norm, nn.LayerNorm) and model.head.out_features == 20
    assert GPTConfig(vocab_size=20, hidden=32, heads=4).ffn_hidden == 128


@pytest.mark.parametrize("tied", [False, True])
def test_the_parameter_count_is_the_theorys(tied):
    model = _model(tie_embeddings=tied)
    shape = theory.TransformerShape(
        layers=4, hidden=32, heads=4, seq_len=16, vocab=20, ffn_hidden=128, tied_embeddings=tied
    )
    assert sum(p.numel() for p in model.parameters()) == shape.parameters()
    assert (model.head.weight is model.tok.weight) == tied


def test_the_labs_default_model_has_about_0_8m_parameters(text):
    model = GPT(GPTConfig(vocab_size=CharTokenizer(text).vocab_size))
    assert 0.7e6 < sum(p.numel() for p in model.parameters()) < 0.9e6


def test_attention_runs_a_ranks_share_of_the_heads_when_q_k_v_are_cut_by_columns():
    # What tensor parallelism does to a rank's attention, by hand: half of q, k and v's output columns
    # (two of four heads) and the matching half of out's input columns; the two halves sum to the whole.
    torch.manual_seed(0)
    attn = Attention(GPTConfig(**SMALL))
    x = torch.randn(2, 16, 32)
    halves = []
    for cols in (slice(0, 16), slice(16, 32)):
        part = copy.deepcopy(attn)
        for name in ("q", "k", "v"):
            linear = getattr(part, name)
            linear.weight = nn.Parameter(linear.weight[cols])
            linear.bias = nn.Parameter(linear.bias[cols])
        part.out.weight = nn.Parameter(attn.out.weight[:, cols])
        part.out.bias = nn.Parameter(torch.zeros(32))  # the bias is added once, after the sum
        halves.append(part(x))
    torch.testing.assert_close(halves[0] + halves[1] + attn.out.bias, attn(x))


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    plain, recomputed = _model(), _model()
    recomputed.set_activation_checkpointing(True)
    assert recomputed.checkpointing
    idx, targets = _ids(), _ids(seed=2)
    losses = []
    for model in (plain, recomputed):
        _, loss = model(idx, targets)
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[0], losses[1])
    for a, b in zip(plain.parameters(), recomputed.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_the_labs_model_learns_the_text(text, tokens):
    torch.manual_seed(0)
    tok = CharTokenizer(text)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, seq_len=32, layers=2, hidden=64, heads=4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _, (x, y) in zip(range(40), token_batches(tokens, batch_size=8, seq_len=32)):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # It starts near a uniform guess, ln(vocab), and within 40 steps has learnt at least which
    # characters are common.
    assert abs(losses[0] - math.log(tok.vocab_size)) < 0.3
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"vocab_size": 20, "hidden": 30, "heads": 4}, "hidden=30 must be a multiple of heads=4"),
        ({"vocab_size": 0}, "vocab_size must be >= 1"),
        ({"vocab_size": 20, "dropout": 1.0}, "dropout is a fraction"),
    ],
)
def test_a_bad_config_is_one_clear_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**kwargs)


def test_a_sequence_longer_than_the_positions_is_refused():
    with pytest.raises(ValueError, match="seq <= seq_len=16"):
        _model()(_ids(seq=17))
    with pytest.raises(ValueError, match="on must be True or False"):
        _model().set_activation_checkpointing(1)


# --- how it splits -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("stages", "blocks"), [(1, [4]), (2, [2, 2]), (3, [2, 1, 1]), (4, [1, 1, 1, 1])])
def test_pipeline_stages_chained_are_the_model(stages, blocks):
    model = _model()
    parts = pipeline_stages(model, stages)
    assert [len(part.blocks) for part in parts] == blocks
    x = _ids()
    for part in parts:
        x = part(x)
    torch.testing.assert_close(x, model(_ids()))
    # The stages hold the model's own modules, nothing copied.
    stage_params = {id(p) for part in parts for p in part.parameters()}
    assert stage_params == {id(p) for p in model.parameters()}
    assert parts[0].tok is model.tok and parts[-1].head is model.head


def test_pipeline_stages_refuse_what_cannot_be_split():
    with pytest.raises(ValueError, match="stages=5 is more than the model's 4 blocks"):
        pipeline_stages(_model(), 5)
    with pytest.raises(ValueError, match="tie_embeddings=False"):
        pipeline_stages(_model(tie_embeddings=True), 2)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_the_tensor_parallel_plan_splits_every_block_as_megatron_does(sequence_parallel):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    plan = tensor_parallel_plan(_model(), sequence_parallel=sequence_parallel)
    for i in range(4):
        for name in ("attn.q", "attn.k", "attn.v", "mlp.fc"):
            assert isinstance(plan[f"blocks.{i}.{name}"], ColwiseParallel)
        for name in ("attn.out", "mlp.proj"):
            assert isinstance(plan[f"blocks.{i}.{name}"], RowwiseParallel)
        for name in ("ln1", "ln2"):
            assert isinstance(plan.get(f"blocks.{i}.{name}"), SequenceParallel) == sequence_parallel
    assert isinstance(plan.get("norm"), SequenceParallel) == sequence_parallel


def test_the_peak_matmul_rate_is_a_measured_rate():
    rate = peak_matmul_flops_per_s(size=128, repeats=2, device="cpu")
    assert math.isfinite(rate) and rate > 0
    with pytest.raises(ValueError, match="size must be >= 1"):
        peak_matmul_flops_per_s(size=0)


# --- on a real 2-rank lab ----------------------------------------------------------------------------

# Run on the ranks and here alike: the model and the batch (the real text).
SETUP = """
import torch
from distlab.nn import GPT, CharTokenizer, GPTConfig, corpus, token_batches

nn_text = corpus()[:20_000]
nn_tok = CharTokenizer(nn_text)
NN_CONFIG = GPTConfig(vocab_size=nn_tok.vocab_size, seq_len=16, layers=4, hidden=32, heads=4)

def nn_model():
    torch.manual_seed(0)
    return GPT(NN_CONFIG)

def nn_batch():
    return token_batches(nn_tok.encode(nn_text), batch_size=8, seq_len=16)[0]
"""

TENSOR_PARALLEL = """
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module
from distlab.nn import tensor_parallel_plan

def nn_whole(t):
    return t.full_tensor() if isinstance(t, DTensor) else t

def nn_tensor_parallel(sequence_parallel, checkpointing):
    model = nn_model()
    mesh = init_device_mesh("cpu", (world_size,))
    parallelize_module(model, mesh, tensor_parallel_plan(model, sequence_parallel=sequence_parallel))
    model.set_activation_checkpointing(checkpointing)
    stream = []  # the residual stream's shape on this rank, between blocks 0 and 1
    model.blocks[1].register_forward_pre_hook(lambda module, args: stream.append(tuple(args[0].shape)))
    x, y = nn_batch()
    logits, loss = model(x, y)
    loss.backward()
    grads = {name: nn_whole(p.grad) for name, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    after = {name: nn_whole(p.detach()) for name, p in model.named_parameters()}
    q_rows = model.blocks[0].attn.q.weight.to_local().shape[0]
    return {
        "logits": logits.detach(), "loss": loss.detach(), "grads": grads, "after": after,
        "q_rows": q_rows, "stream": stream[0],
    }
"""


def _reference() -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The model of SETUP trained one SGD step in this process on the whole batch."""
    namespace: dict = {}
    exec(SETUP, namespace)  # noqa: S102 -- the same text the ranks run, our own constant
    model = namespace["nn_model"]()
    x, y = namespace["nn_batch"]()
    logits, loss = model(x, y)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    after = {name: p.detach().clone() for name, p in model.named_parameters()}
    return logits.detach(), loss.detach(), grads, after


@pytest.mark.cluster
@pytest.mark.parametrize(
    ("sequence_parallel", "checkpointing"),
    [(False, False), (True, False), (True, True)],
    ids=["tp", "tp+sp", "tp+sp+ac"],
)
def test_tensor_parallel_gradients_equal_single_process_training(lab, sequence_parallel, checkpointing):
    results = lab.run(
        SETUP + TENSOR_PARALLEL + f"nn_tensor_parallel({sequence_parallel}, {checkpointing})", stream=False
    )
    logits, loss, grads, after = _reference()
    assert sorted(results) == [0, 1]
    for rank, got in results.items():
        assert got["q_rows"] == 32 // 2, f"rank {rank} holds all of q: the plan did not shard it"
        # Sequence parallelism leaves each rank half of the sequence between blocks.
        assert got["stream"] == (8, 16 // 2 if sequence_parallel else 16, 32)
        torch.testing.assert_close(got["logits"], logits)
        torch.testing.assert_close(got["loss"], loss)
        assert got["grads"].keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(got["grads"][name], grad, msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}")
            torch.testing.assert_close(got["after"][name], after[name], msg=lambda m, n=name: f"{n} after a step: {m}")


PIPELINE = """
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B
from distlab.nn import pipeline_stages

def nn_pipeline(chunks):
    model = nn_model()
    stages = pipeline_stages(model, world_size * chunks)
    mine = [PipelineStage(stages[i], i, len(stages), torch.device("cpu")) for i in range(rank, len(stages), world_size)]

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    if chunks == 1:
        schedule = Schedule1F1B(mine[0], n_microbatches=4, loss_fn=loss_fn)
    else:
        schedule = ScheduleInterleaved1F1B(mine, n_microbatches=4, loss_fn=loss_fn)
    x, y = nn_batch()
    losses = []
    if rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=y, losses=losses)
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return {"losses": [l.detach() for l in losses], "grads": grads}
"""


@pytest.mark.cluster
@pytest.mark.parametrize("chunks", [1, 2], ids=["1f1b", "interleaved-1f1b"])
def test_a_pipeline_schedule_gives_the_loss_and_gradients_of_the_whole_model(lab, chunks):
    results = lab.run(SETUP + PIPELINE + f"nn_pipeline({chunks})", stream=False)
    _, loss, grads, _ = _reference()
    # The last stage's rank computes the loss of each of the 4 micro-batches; their mean is the batch's.
    assert results[0]["losses"] == [] and len(results[1]["losses"]) == 4
    torch.testing.assert_close(torch.stack(results[1]["losses"]).mean(), loss)
    # Each parameter's gradient is on the one rank holding its stage, scaled as for the whole batch.
    held = [set(results[r]["grads"]) for r in (0, 1)]
    assert not held[0] & held[1] and held[0] | held[1] == set(grads)
    for rank in (0, 1):
        for name, grad in results[rank]["grads"].items():
            torch.testing.assert_close(grad, grads[name], msg=lambda m, n=name: f"{n}: {m}")


FSDP = """
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

def nn_fsdp():
    model = nn_model()
    model.set_activation_checkpointing(True)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x, y = nn_batch()
    share = slice(rank * len(x) // world_size, (rank + 1) * len(x) // world_size)
    _, loss = model(x[share], y[share])
    loss.backward()
    return {name: p.grad.full_tensor() for name, p in model.named_parameters()}
"""


@pytest.mark.cluster
def test_fsdp2_with_checkpointed_blocks_gives_the_gradients_of_the_whole_batch(lab):
    results = lab.run(SETUP + FSDP + "nn_fsdp()", stream=False)
    _, _, grads, _ = _reference()
    for rank, got in results.items():
        assert got.keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(got[name], grad, msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}")
