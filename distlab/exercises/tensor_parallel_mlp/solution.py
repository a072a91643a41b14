class _CopyToRanks(torch.autograd.Function):
    """Megatron's f: the identity in forward; in backward, sum the input's gradient over the ranks."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()  # all_reduce writes in place: leave autograd's tensor alone
        dist.all_reduce(grad)
        return grad


class _SumOverRanks(torch.autograd.Function):
    """Megatron's g: sum the partial outputs over the ranks in forward; the identity in backward."""

    @staticmethod
    def forward(ctx, partial):
        total = partial.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad  # every rank already holds the whole gradient of the output


class TPMLP(torch.nn.Module):
    """y = gelu(x @ w1.T + b1) @ w2.T + b2, hidden features split over the ranks."""

    def __init__(self, w1, b1, w2, b2):
        super().__init__()
        k = w1.shape[0] // world_size
        rows = slice(rank * k, (rank + 1) * k)
        self.w1 = torch.nn.Parameter(w1[rows].clone())  # column-parallel: this rank's hidden features
        self.b1 = torch.nn.Parameter(b1[rows].clone())
        self.w2 = torch.nn.Parameter(w2[:, rows].clone())  # row-parallel: the columns that read them
        self.b2 = torch.nn.Parameter(b2.clone())  # whole, added once after the sum

    def forward(self, x):
        x = _CopyToRanks.apply(x)
        hidden = torch.nn.functional.gelu(x @ self.w1.T + self.b1)
        return _SumOverRanks.apply(hidden @ self.w2.T) + self.b2
