def moe_forward(x, expert_of, capacity, expert):
    """Expert parallelism's two all-to-alls: each kept token to its expert's rank and back, fixed capacity."""
    d = x.shape[1]
    send = torch.zeros(world_size * capacity, d, dtype=x.dtype)
    rows = []  # (token, row of the buffer) of every kept token
    for e in range(world_size):
        kept = (expert_of == e).nonzero().flatten()[:capacity]  # the first `capacity` keep their slot
        for k, t in enumerate(kept.tolist()):
            rows.append((t, e * capacity + k))
    tokens = torch.tensor([t for t, _ in rows], dtype=torch.long)
    slots = torch.tensor([s for _, s in rows], dtype=torch.long)
    if rows:
        send[slots] = x[tokens]
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send)  # dispatch: block e to rank e
    done = expert(received)  # this rank's expert, on every rank's rows for it
    back = torch.empty_like(done)
    dist.all_to_all_single(back, done)  # combine: each block home to the rank it came from
    out = torch.zeros_like(x)
    if rows:
        out[tokens] = back[slots]
    return out
