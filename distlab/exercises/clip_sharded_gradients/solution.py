def clip_grad_norm(model, max_norm):
    """Clip every gradient by the norm of the whole gradient, from this rank's shards and one all-reduce."""
    grads = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
    squares = torch.zeros((), dtype=torch.float64)
    for g in grads:
        squares += g.double().pow(2).sum()
    dist.all_reduce(squares)
    norm = squares.sqrt().item()
    scale = max_norm / (norm + 1e-6)
    if scale < 1:
        for g in grads:
            g.mul_(scale)
    return norm
