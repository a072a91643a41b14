from ..model import Exercise

EXERCISE = Exercise(
    name="diloco-outer-step",
    title="DiLoCo's outer step",
    lesson="21b-local-sgd-diloco.ipynb",
    task="""\
DiLoCo (Douillard et al. 2023) lets each rank take H steps of its own optimizer on its own data, then
synchronises once: it averages the ranks' models and treats the change the average made since the
last synchronisation as a gradient for an **outer** optimizer (SGD with Nesterov momentum in the
paper). Every rank keeps `anchor`, the weights at the last synchronisation (the same on every
rank), and an outer optimizer `outer_opt` built over the anchor's tensors.

Write `outer_step(model, anchor, outer_opt)`, called after the H inner steps:

1. average each parameter of `model` over the ranks;
2. give each anchor tensor the **outer gradient** `anchor - average` as its `.grad` (the direction
   the ranks moved, negated, as a gradient points the other way from where the step goes);
3. step `outer_opt` (it updates the anchor tensors in place);
4. copy the new anchor into the model's parameters, in place: every rank starts its next H inner
   steps from the same weights.

`anchor` is a list of tensors, one per parameter in `model.parameters()` order. Do not rebuild the
optimizer: its momentum carries over from one outer step to the next. The grader moves each rank's
model its own way (as its inner steps would), calls your function for 3 outer steps in worlds of 2
and 3 ranks, and compares the anchor and the model with DiLoCo's, computed on one process, after
each (float32 rounding).""",
    starter="""\
%%ddp
def outer_step(model, anchor, outer_opt):
    with torch.no_grad():
        # 1. the average of each parameter over the ranks
        # 2. a.grad = the outer gradient, for each anchor tensor a
        # 3. the outer optimizer's step
        # 4. the model's parameters set to the new anchor
        ...
""",
    hints=(
        "`dist.all_reduce` sums in place: all-reduce a copy of each parameter, then divide by the world size.",
        "The outer gradient points from the average back to the anchor: subtract the average from the anchor.",
        "After `outer_opt.step()` the anchor tensors hold the new weights; `p.copy_` writes them into the "
        "model without replacing its parameters.",
    ),
    defines=("outer_step",),
    world_sizes=(2, 3),
    case_timeout_s=30.0,
)
