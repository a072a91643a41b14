import math


def shard_rows(rows, world_size, rank):
    """The rows of dim 0 rank ``rank``'s FSDP2 shard holds: torch.chunk's split."""
    chunk = math.ceil(rows / world_size)
    return max(0, min(chunk, rows - rank * chunk))


def shard_bytes(shapes, world_size):
    """The float32 bytes every rank allocates for these parameters: each shard padded to a full chunk."""
    return sum(4 * math.ceil(shape[0] / world_size) * math.prod(shape[1:]) for shape in shapes)
