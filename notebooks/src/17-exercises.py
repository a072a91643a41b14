# %% [markdown]
# # 17 · Build it yourself: exercises graded on the ranks
#
# The quizzes ask what you remember. Here you build the thing: average gradients by hand, a sampler,
# a ring all-reduce from `send` and `recv`, a parameter server, DDP from autograd hooks, ZeRO-1, a
# tensor-parallel MLP, a 1F1B pipeline and a checkpoint that survives a kill. You write each in a
# `%%ddp` cell, as you would write it on a cluster, and distlab grades it **on ranks**, against
# torch's own collectives, DDP or a single-process reference, and against the theory where speed is
# the point.
#
# How a check works:
#
# * your definitions are taken from your ranks (pickled by value: a function made in a cell lives
#   in no module) and sent to **ranks of the grader's own**: a second lab it starts at the first
#   check, resizes to each world the exercise is graded in (2, 3 or 4 ranks), and stops with yours.
#   Your lab keeps its size, its names and its state, whatever your code does;
# * each exercise draws its **cases** from a seed: random sizes (many not divisible by the world
#   size), shapes and dtypes. Every result says its seed; `check(NAME, seed=...)` draws the same
#   cases again;
# * each case has a **deadline**: code that deadlocks is stopped, and the feedback names the ranks
#   and the line each was waiting on. The cases after it are not run;
# * the feedback names the case, the first rank where it went wrong, what was wrong (the first wrong
#   element, parameter or index) and, for the mistakes learners really make, the mistake;
# * your code never runs in this notebook's process, and the result is saved with your quiz
#   progress (`%quiz` with no topic shows both).

# %%
# %load_ext distlab
# %dist start -n 2

# %% [markdown]
# `%exercise` lists the exercises in the order of the course, each with the lesson that teaches its
# topic and your result so far.

# %%
# %exercise

# %% [markdown]
# ## A first exercise, start to finish
#
# `%exercise NAME` shows the task and its starter code. In JupyterLab the starter also appears as a
# new cell below, ready to fill in; `%exercise hint NAME` gives the hints one at a time.

# %%
# %exercise average-gradients

# %% [markdown]
# A first try, with the mistake almost everyone makes once: `all_reduce` leaves the **sum** of the
# ranks' gradients on every rank, not their mean.

# %%
# %%ddp
def average_gradients(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)

# %% [markdown]
# `distlab.exercises.check` is what `%exercise check average-gradients` calls; it returns the
# result: `.passed`, `.feedback` and the cases, shown as a table.

# %%
import distlab
from distlab import exercises

result = exercises.check("average-gradients", seed=0)
result

# %% tags=["nbval-check-output"]
print("passed:", result.passed)
print("the feedback names the mistake:", "divide by the world size" in result.feedback)
print("every case ran, in worlds of", sorted({case.world_size for case in result.cases}), "ranks")

# %% [markdown]
# The feedback says the gradients are `world_size` times DDP's. Divide, and skip the parameters
# that have no gradient (a frozen layer's are `None`, and one of the cases freezes one):

# %%
# %%ddp
def average_gradients(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world_size

# %%
result = exercises.check("average-gradients", seed=0)
result

# %% tags=["nbval-check-output"]
print("passed:", result.passed)

# %% [markdown]
# ## When a solution deadlocks
#
# Point-to-point code deadlocks easily: here both ranks wait to receive first, and nobody sends.
# The grader stops the case at its deadline (shortened to 5 s here; the exercise's own is 30 s),
# names where each rank was stuck, and your lab is untouched.

# %%
# %%ddp
def average_gradients(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.recv(p.grad, src=1 - rank)

# %%
stuck = exercises.check("average-gradients", seed=0, case_timeout_s=5)
print(stuck.feedback)

# %% tags=["nbval-check-output"]
print("stopped and named:", "never returned from line 4 of average_gradients" in stuck.feedback)
print("cases not run after it:", sum(not case.ran for case in stuck.cases) > 0)
print("this lab still has its 2 ranks and works:", distlab.current_lab().run("world_size", stream=False) == {0: 2, 1: 2})

# %% [markdown]
# ## The exercises
#
# | exercise | what you build | lesson |
# |---|---|---|
# | `average-gradients` | gradients averaged by hand after backward, equal to DDP's | [01](01-data-parallelism.ipynb) |
# | `distributed-sampler` | a sampler giving each rank a disjoint, covering, padded slice, reshuffled by `set_epoch` | [02](02-data-loading.ipynb) |
# | `ring-allreduce` | all-reduce from `send` and `recv` only: reduce-scatter, then all-gather around a ring; timed against `dist.all_reduce` and the ring model | [03](03-collectives-cost.ipynb) |
# | `parameter-server` | a synchronous parameter server from `send` and `recv` | [04](04-sync-async.ipynb) |
# | `ddp-from-hooks` | DDP from autograd hooks: buckets, asynchronous all-reduce overlapping backward | [03](03-collectives-cost.ipynb) |
# | `zero-1` | Adam's state sharded across ranks, from reduce-scatter and all-gather | [06](06-memory-sharding.ipynb) |
# | `tensor-parallel-mlp` | a column- then row-split MLP: one all-reduce forward, one backward | [14b](14b-dtensor-tensor-parallel.ipynb) |
# | `pipeline-1f1b` | a 1F1B schedule on 2 stages; its bubble, laid out from the order it ran, graded against theory | [16](16-pipeline-schedules.ipynb) |
# | `diverged-replicas` | the parameters whose replicas are not equal bit for bit on every rank, from a few bytes of fingerprint each | [18](18-debugging.ipynb) |
# | `clip-sharded-gradients` | clip an FSDP2 model's gradients by the whole gradient's norm, from each rank's shards and one all-reduce | [19](19-two-tiers-hsdp.ipynb) |
# | `expert-dispatch` | a mixture-of-experts layer's dispatch and combine by two all-to-alls, with each expert's capacity | [20](20-context-expert-parallelism.ipynb) |
# | `diloco-outer-step` | DiLoCo's outer step: the change the replicas' average made, as the outer optimizer's gradient | [21b](21b-local-sgd-diloco.ipynb) |
# | `ddp-comm-hook` | DDP's averaging as a communication hook on its buckets | [22](22-compile-ddp-fsdp2.ipynb) |
# | `fsdp-shard-sizes` | the rows each rank's FSDP2 shard holds and the padded bytes every rank allocates | [23](23-at-scale.ipynb) |
# | `atomic-checkpoint` | a save that survives a SIGKILL mid-write | [09](09-fault-tolerance.ipynb) |
#
# The flagship: a ring all-reduce. Run the next cell, fill in the starter it gives you, and check it.
# The grader tries it at 2, 3 and 4 ranks, on sizes that do not divide evenly, on integers (exactly)
# and floats (within rounding), and counts the bytes each rank sends: a ring sends `2(N-1)/N` of the
# tensor, and sending the whole tensor to everyone is named for what it is.

# %%
# %exercise ring-allreduce

# %% [markdown]
# ## Grading a course
#
# A teacher grades a learner's notebook headless: it runs top to bottom in a fresh kernel (a cell
# that fails does not stop it), then every exercise is graded on the lab the notebook started, and
# the grades are printed as JSON (an exercise whose names are not defined is "not attempted"):
#
# ```
# python -m distlab.exercises grade learner.ipynb [--exercise ring-allreduce ...]
# ```

# %%
# %dist stop
