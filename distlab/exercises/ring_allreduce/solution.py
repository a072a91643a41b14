def ring_all_reduce(tensor):
    """Sum ``tensor`` over all ranks, in place, from send/recv: a ring reduce-scatter, then a ring all-gather."""
    n = dist.get_world_size()
    me = dist.get_rank()
    if n == 1:
        return tensor
    right, left = (me + 1) % n, (me - 1) % n
    # N views of the flat tensor, sizes differing by at most one element (some empty when it has fewer
    # than N elements); writing into a view writes into `tensor`.
    chunks = list(tensor.view(-1).tensor_split(n))
    incoming = torch.empty_like(chunks[0])  # tensor_split puts the larger chunks first

    # Reduce-scatter: at step s, pass chunk (me - s) to the right and add the left's chunk (me - s - 1)
    # to ours. After N-1 steps this rank holds the full sum of chunk (me + 1).
    for step in range(n - 1):
        out, into = (me - step) % n, (me - step - 1) % n
        received = incoming[: chunks[into].numel()]
        request = dist.isend(chunks[out], right)  # isend: every rank sends and receives at once, no deadlock
        dist.recv(received, left)
        request.wait()
        chunks[into] += received

    # All-gather: pass the finished chunks around the ring, copying (not adding) what arrives.
    for step in range(n - 1):
        out, into = (me + 1 - step) % n, (me - step) % n
        request = dist.isend(chunks[out], right)
        dist.recv(chunks[into], left)
        request.wait()
    return tensor
