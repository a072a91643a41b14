def one_f_one_b(stage, micro_batches, targets, loss_fn, activation_shape):
    """One training step of a 2-stage pipeline in 1F1B order; rank 1 returns the mean loss."""
    if rank == 0:
        m = len(micro_batches)
        outputs, sends = {}, []

        def forward(i):
            outputs[i] = stage(micro_batches[i])
            # isend: go on with the next forward while the activation travels; wait for it before returning.
            activation = outputs[i].detach()
            sends.append((dist.isend(activation, dst=1), activation))

        def backward(i):
            grad = torch.empty(activation_shape)
            dist.recv(grad, src=1)
            outputs.pop(i).backward(grad)  # accumulates into the stage's .grad

        warmup = min(2, m)  # p - stage forwards before the first backward
        for i in range(warmup):
            forward(i)
        for i in range(m):
            backward(i)
            if i + warmup < m:
                forward(i + warmup)
        for request, _ in sends:
            request.wait()
        return None

    m = len(targets)
    total, sends = 0.0, []
    for i in range(m):
        x = torch.empty(activation_shape)
        dist.recv(x, src=0)
        x.requires_grad_()  # so that backward computes the gradient stage 0 needs
        loss = loss_fn(stage(x), targets[i]) / m  # the step's loss is the mean over the micro-batches
        loss.backward()
        sends.append(dist.isend(x.grad, dst=0))
        total += loss.item()
    for request in sends:
        request.wait()
    return total
