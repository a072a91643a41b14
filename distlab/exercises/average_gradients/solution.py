def average_gradients(model):
    """Average every gradient across the ranks, in place: what DDP does after backward."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= dist.get_world_size()
