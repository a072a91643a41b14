# %% [markdown]
# # 06 · Memory: what training holds per parameter, and sharding it
#
# Plain data parallelism keeps a **full copy of everything** on every device: weights, gradients and
# optimizer states. For Adam in mixed precision that is about **16 bytes per parameter**, as the ZeRO
# paper counts it (Rajbhandari et al. 2020; other systems keep other layouts, notebook 07):
#
# | what | bytes |
# |---|---|
# | 16-bit weights | 2 |
# | 16-bit gradients | 2 |
# | fp32 master weights | 4 |
# | Adam first moment m (fp32) | 4 |
# | Adam second moment v (fp32) | 4 |
#
# plus activations and buffers. **ZeRO** removes the redundancy by sharding over the N data-parallel
# devices: stage 1 shards the optimizer states, stage 2 the gradients too, stage 3 the weights too
# (PyTorch's form of stage 3 is **FSDP**, Fully Sharded Data Parallel). Offloading states to CPU memory
# is the next lever after that.

# %% tags=["nbval-check-output"]
from distlab import theory

GB = 1e9
print("2B parameters, mixed-precision Adam, one device:",
      theory.memory_per_device_bytes(2e9) / GB, "GB")
print("ZeRO-3 over 8 devices:", theory.memory_per_device_bytes(2e9, devices=8, zero_stage=3) / GB, "GB each")
print("plus 3 GB of activations and buffers:",
      theory.memory_per_device_bytes(2e9, devices=8, zero_stage=3, activation_bytes=3e9) / GB,
      "GB: fits a 16 GB device")
for stage in (0, 1, 2, 3):
    b = theory.memory_breakdown(2e9, devices=8, zero_stage=stage)
    print(f"stage {stage}: weights {b.weights_bytes / GB:4.1f} + gradients {b.gradients_bytes / GB:4.1f} "
          f"+ optimizer states {b.optimizer_states_bytes / GB:5.1f} = {b.total_bytes / GB:5.1f} GB per device")

# %% [markdown]
# ## Measuring it on two ranks
#
# Now for real, on a model of 2.1 M parameters (eight 512 x 512 layers) trained in fp32 with Adam,
# three ways:
#
# * **DDP + Adam**: everything replicated;
# * **DDP + `ZeroRedundancyOptimizer`**: PyTorch's ZeRO stage 1, each rank keeps the Adam states of its
#   half of the parameters, updates that half, and broadcasts it;
# * **FSDP** (`fully_shard`, ZeRO stage 3): each rank stores half of every layer's weights, gradients and
#   states; a layer's full weights are gathered just before it is used and freed after.
#
# On each rank we add up the bytes of the tensors it actually holds: its (local shards of) weights,
# gradients and optimizer states.

# %%
# %load_ext distlab
# %dist start -n 2

# %% [markdown]
# Before measuring, predict one of the numbers from the formulas above:

# %%
from distlab.quiz import predict

P = 8 * (512 * 512 + 512)                     # eight 512 x 512 layers with their biases


def fsdp_bytes(parameters, devices):
    """theory's per-rank bytes of weights, gradients and Adam states under ZeRO-3."""
    b = theory.memory_breakdown(parameters, devices=devices, zero_stage=3, precision="fp32", optimizer="adam")
    return b.total_bytes


guess = predict(f"The model has {P:,} parameters, trained in fp32 with Adam on 2 ranks. How many MB of weights, "
                "gradients and Adam states will FSDP keep on each rank?",
                theory=fsdp_bytes, unit="MB", tolerance=0.1, parameters=P, devices=2)
guess

# %%
# %%ddp
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

def make():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])

def local(t):
    return t.to_local() if hasattr(t, "to_local") else t      # an FSDP parameter is a sharded DTensor

def nbytes(tensors):
    return sum(local(t).numel() * local(t).element_size() for t in tensors)

def held(model, opt):
    inner = getattr(opt, "optim", opt)                         # ZeRO wraps this rank's own Adam
    states = [v for s in inner.state.values() for k, v in s.items() if k != "step"]
    return {"weights": nbytes(model.parameters()),
            "gradients": nbytes(p.grad for p in model.parameters() if p.grad is not None),
            "optimizer states": nbytes(states)}

def train(kind, steps=5):
    net = make().to(device)
    if kind == "fsdp":
        for layer in net:
            fully_shard(layer)
        model = fully_shard(net)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        model = DDP(net)
        opt = (ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
               if kind == "zero" else torch.optim.Adam(model.parameters(), lr=1e-3))
    watch = distlab.watch(model) if kind == "ddp" else None
    for step in range(steps):
        x = torch.randn(16, 512, generator=torch.Generator().manual_seed(100 * step + rank)).to(device)
        loss = model(x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        distlab.log(loss=loss)
    if watch:
        watch.close()
    final = [(p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()).cpu()   # for the notebook
             for p in model.parameters()]
    return held(model, opt), final

memory, final = {}, {}
for kind in ("ddp", "zero", "fsdp"):
    memory[kind], final[kind] = train(kind)

# %% tags=["nbval-check-output"]
import torch
import distlab

lab = distlab.current_lab()
memory, final = lab.pull("memory"), lab.pull("final")
P = sum(t.numel() for t in final[0]["ddp"])
MB = 1e6
print(f"parameters: {P:,}\n")
print(f"{'':>5} {'':>17} {'rank 0':>8} {'rank 1':>8} {'theory':>8}   (MB per rank)")
for kind, stage in (("ddp", 0), ("zero", 1), ("fsdp", 3)):
    b = theory.memory_breakdown(P, devices=2, zero_stage=stage, precision="fp32", optimizer="adam")
    expected = {"weights": b.weights_bytes, "gradients": b.gradients_bytes,
                "optimizer states": b.optimizer_states_bytes}
    for part in expected:
        print(f"{kind:>5} {part:>17} {memory[0][kind][part] / MB:>8.3f} {memory[1][kind][part] / MB:>8.3f} "
              f"{expected[part] / MB:>8.3f}")

# %%
guess.reveal(sum(memory[0]["fsdp"].values()))             # the bytes rank 0 measured under FSDP

# %% [markdown]
# Measured and predicted agree to the byte: the formulas are simply counting tensors. With ZeRO-1 each
# rank keeps Adam's states for half of the parameters (`ZeroRedundancyOptimizer` assigns whole
# tensors to ranks, balancing their sizes; here the layers are equal, so the halves are exact). With
# FSDP every part is halved. With N devices, the sharded parts shrink as 1/N.
#
# (The table leaves out one more copy: plain DDP also keeps its gradient **buckets**, flat buffers as
# large as all the gradients, unless `gradient_as_bucket_view=True` makes the gradients live inside
# them.)
#
# Sharding changes where the bytes live, not what is computed: the three runs must end with the same
# weights.

# %% tags=["nbval-check-output"]
same = lambda a, b: all(torch.allclose(x, y, atol=1e-5) for x, y in zip(a, b))
for r in (0, 1):
    print(f"rank {r}: ZeRO-1 matches plain Adam: {same(final[r]['zero'], final[r]['ddp'])}, "
          f"FSDP matches plain Adam: {same(final[r]['fsdp'], final[r]['ddp'])}")

# %% [markdown]
# What it costs instead of memory: communication. ZeRO-1 adds a broadcast of every updated shard after
# the step. FSDP all-gathers each layer's weights before its forward (and again before its backward)
# and reduce-scatters the gradients, about 1.5x the traffic of DDP's all-reduce, in exchange for holding
# only 1/N of the model between uses. The plain DDP run, as the dashboard saw it (its all-reduce is the
# traffic the sharded versions trade memory against):

# %%
lab.dashboard()

# %% [markdown]
# ## Practice

# %%
# %quiz memory-sharding -n 4

# %% [markdown]
# ## Build it yourself
#
# The exercise for this lesson (notebook [17](17-exercises.ipynb) introduces them; each is graded on ranks
# the grader starts itself, and the feedback names what is wrong):
#
# * `%exercise zero-1`: Adam's state sharded over the ranks from reduce-scatter and all-gather, its memory per rank against 1/N.

# %%
# %dist stop
