class HookDDP:
    """DDP's gradient averaging from hooks: buckets filled as gradients become ready, each all-reduced
    asynchronously as soon as it is full, while backward computes the rest."""

    def __init__(self, model, bucket_cap_bytes):
        self.cap = bucket_cap_bytes
        self.bucket, self.bucket_bytes = [], 0
        self.pending = []  # (work, flat tensor, the parameters it holds)
        for p in model.parameters():
            if p.requires_grad:  # once, here: registering every step would reduce gradients twice
                p.register_post_accumulate_grad_hook(self._ready)

    def _ready(self, p):
        self.bucket.append(p)
        self.bucket_bytes += p.grad.numel() * p.grad.element_size()
        if self.bucket_bytes >= self.cap:
            self._launch()

    def _launch(self):
        flat = torch.cat([p.grad.reshape(-1) for p in self.bucket])
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True)
        self.pending.append((work, flat, self.bucket))
        self.bucket, self.bucket_bytes = [], 0

    def finish(self):
        if self.bucket:  # the last bucket, never filled to the cap
            self._launch()
        for work, flat, params in self.pending:
            work.wait()
            flat /= dist.get_world_size()
            offset = 0
            for p in params:
                n = p.grad.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                offset += n
        self.pending = []
