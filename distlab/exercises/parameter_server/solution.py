def parameter_server_step(params, grads, lr):
    """One synchronous step: workers push gradients, rank 0 averages them, steps, and pushes params back."""
    if rank == 0:
        total = [torch.zeros_like(p) for p in params]
        received = [torch.empty_like(p) for p in params]
        for worker in range(1, world_size):
            for t, r in zip(total, received):
                dist.recv(r, src=worker)
                t += r
        workers = world_size - 1  # the server's own (zero) gradient is not averaged
        with torch.no_grad():
            for p, t in zip(params, total):
                p -= lr * t / workers
        for worker in range(1, world_size):
            for p in params:
                dist.send(p, dst=worker)
    else:
        # Send everything first, then receive: rank 0 receives all of it before it sends anything.
        for g in grads:
            dist.send(g, dst=0)
        for p in params:
            dist.recv(p, src=0)  # straight into the parameter: updated in place
