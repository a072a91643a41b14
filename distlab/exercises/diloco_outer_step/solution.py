def outer_step(model, anchor, outer_opt):
    """Average the ranks' models, step the outer optimizer on anchor - average, start again from the anchor."""
    with torch.no_grad():
        for p, a in zip(model.parameters(), anchor):
            mean = p.detach().clone()
            dist.all_reduce(mean)
            mean /= dist.get_world_size()
            a.grad = a - mean
        outer_opt.step()
        for p, a in zip(model.parameters(), anchor):
            p.copy_(a)
