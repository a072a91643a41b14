from ..model import Exercise

EXERCISE = Exercise(
    name="expert-dispatch",
    title="Expert parallelism: dispatch and combine by all-to-all",
    lesson="20-context-expert-parallelism.ipynb",
    task="""\
A mixture-of-experts layer with one expert per rank: expert `e` lives on rank `e`. Every rank has
its own tokens and has routed each one to an expert already. Write the layer's communication with
a fixed capacity, as GShard and the Switch Transformer do:

* each expert has `capacity` slots for each rank's tokens: the first `capacity` tokens of this rank
  routed to expert `e` (in token order) get a slot, the others are **dropped**;
* **dispatch**: one `dist.all_to_all_single` sends every rank's block for expert `e` to rank `e`. The
  block has exactly `capacity` rows whatever the tokens routed (padded with zeros), so the buffer
  each rank sends has `world_size * capacity` rows, block `e` for rank `e`;
* this rank's `expert` computes all the rows it received, `world_size * capacity` of them;
* **combine**: a second `dist.all_to_all_single` sends the results back to the ranks the rows came
  from, and each rank puts every kept token's result in that token's row.

Write `moe_forward(x, expert_of, capacity, expert)`:

* `x`: this rank's tokens, a float32 tensor `[T, d]`;
* `expert_of`: a `torch.long` tensor `[T]`, each token's expert (a rank);
* `capacity`: the slots per expert for this rank's tokens (an int, at least 1);
* `expert`: this rank's expert, a function from `[n, d]` to `[n, d]`.

It returns `[T, d]`: row `t` is `expert_of[t]`'s expert applied to `x[t]` for a kept token, and
zeros for a dropped one.

Grading, in worlds of 2 and 4 ranks: each rank's output must equal what one process holding every
expert computes, within float32 rounding. Routing is skewed, so some experts overflow and some get no
token at all, and capacities run from 1 to more than the tokens. Exactly two all-to-alls must run,
each of `world_size * capacity * d` float32 numbers, and no other collective: gathering every rank's
tokens everywhere would move N times the bytes.""",
    starter="""\
%%ddp
def moe_forward(x, expert_of, capacity, expert):
    T, d = x.shape
    # 1. each token's slot at its expert: the first `capacity` tokens for each expert keep theirs
    # 2. dispatch: a [world_size * capacity, d] buffer, block e for rank e, sent by all-to-all
    # 3. this rank's expert on every row it received
    # 4. combine: the results back by all-to-all, each kept token's row put in place; dropped rows zero
    ...
""",
    hints=(
        (
            "For expert e, `(expert_of == e).nonzero().flatten()[:capacity]` are the tokens that keep a slot, "
            "in token order; slot k of expert e is row `e * capacity + k` of the buffer you send."
        ),
        (
            "`received = torch.empty_like(send); dist.all_to_all_single(received, send)`: with no split sizes, "
            "rank r's block r of `send` lands in block (this rank) of rank r's `received`, every block "
            "`capacity` rows."
        ),
        (
            "The combine undoes the dispatch. With every block the same size, an all-to-all is its own inverse: "
            "each expert's result travels back to the rank, and the slot, its token came from."
        ),
    ),
    defines=("moe_forward",),
    world_sizes=(2, 4),
    case_timeout_s=30.0,
)
