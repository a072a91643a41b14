import math


class Zero1Adam:
    """Adam whose state (exp_avg, exp_avg_sq) each rank keeps for its 1/N of the flattened parameters only."""

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-8):
        self.params = list(params)
        self.lr, self.betas, self.eps = lr, betas, eps
        self.numel = sum(p.numel() for p in self.params)
        self.shard = math.ceil(self.numel / world_size)  # padded: collectives on gloo need equal shards
        self.start = rank * self.shard
        self.exp_avg = torch.zeros(self.shard)
        self.exp_avg_sq = torch.zeros(self.shard)
        self.t = 0

    def _padded(self, tensors):
        flat = torch.zeros(self.shard * world_size)
        flat[: self.numel] = torch.cat([t.detach().reshape(-1) for t in tensors])
        return flat

    def step(self):
        self.t += 1
        beta1, beta2 = self.betas
        # Sum each rank's gradients, keeping only this rank's shard of the sum; then the mean.
        grad = torch.empty(self.shard)
        dist.reduce_scatter_single(grad, self._padded(p.grad for p in self.params))
        grad /= world_size
        # Adam on this rank's shard only.
        param = self._padded(self.params)[self.start : self.start + self.shard].clone()
        self.exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        m_hat = self.exp_avg / (1 - beta1**self.t)
        v_hat = self.exp_avg_sq / (1 - beta2**self.t)
        param -= self.lr * m_hat / (v_hat.sqrt() + self.eps)
        # Every rank gets every updated shard back.
        full = torch.empty(self.shard * world_size)
        dist.all_gather_single(full, param)
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(full[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
