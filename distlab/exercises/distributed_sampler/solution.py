import math


class ShardSampler:
    """Each rank's share of a data set's indices, as torch's DistributedSampler gives it (drop_last=False)."""

    def __init__(self, dataset_len, num_replicas, rank, shuffle=True, seed=0):
        self.dataset_len = dataset_len
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.num_samples = math.ceil(dataset_len / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        if self.shuffle:
            # The same generator seed on every rank: one permutation, which the ranks then slice.
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(self.dataset_len, generator=g).tolist()
        else:
            indices = list(range(self.dataset_len))
        padding = self.total_size - len(indices)
        if padding > 0:
            # Repeat from the start (more than once when the data set is smaller than the padding).
            indices += (indices * math.ceil(padding / len(indices)))[:padding]
        return iter(indices[self.rank : self.total_size : self.num_replicas])

    def __len__(self):
        return self.num_samples
