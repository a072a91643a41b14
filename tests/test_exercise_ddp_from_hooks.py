"""ddp-from-hooks: the reference overlaps as theory says; the mistakes learners make, each named (graded by
test_exercises_graded.py)."""

from __future__ import annotations

from _exercises import Harness

from distlab.exercises.results import ExerciseResult

harness = Harness("ddp-from-hooks")


def reference_measures(result: ExerciseResult) -> None:
    for case in result.cases:
        assert case.measured["buckets"] == case.measured["expected_buckets"], case
        # Every full bucket is launched during backward; only the last, partly filled one waits for finish().
        assert case.measured["launched_in_finish"] <= 1, case
        assert case.measured["overlap_launched"] == case.measured["overlap_theory"], case
    assert any(case.measured["launched_in_backward"] >= 2 for case in result.cases)
    assert any(case.measured["overlap_theory"] > 0.5 for case in result.cases)


# The reference's skeleton, with the bucket logic the mistakes change.
_SKELETON = """
class HookDDP:
    def __init__(self, model, bucket_cap_bytes):
        self.cap, self.model = bucket_cap_bytes, model
        self.bucket, self.bucket_bytes, self.pending = [], 0, []
        self.register()

    def register(self):
        for p in self.model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self.ready)

    def ready(self, p):
        {before}
        self.bucket.append(p)
        self.bucket_bytes += p.grad.numel() * p.grad.element_size()
        if {full}:
            self.launch()

    def launch(self):
        flat = torch.cat([p.grad.reshape(-1) for p in self.bucket])
        {launch}
        self.pending.append((work, flat, self.bucket))
        self.bucket, self.bucket_bytes = [], 0

    def finish(self):
        if self.bucket:
            self.launch()
        for work, flat, params in self.pending:
            {wait}
            {divide}
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset : offset + p.grad.numel()].view_as(p.grad))
                offset += p.grad.numel()
        self.pending = []
        {again}
"""
_RIGHT = {
    "full": "self.bucket_bytes >= self.cap",
    "launch": "work = dist.all_reduce(flat, async_op=True)",
    "wait": "work.wait()",
    "divide": "flat /= world_size",
    "again": "",
    "before": "",
}


def _wrong(**change: str) -> str:
    return _SKELETON.format(**{**_RIGHT, **change})


# Every bucket launched, asynchronously and during backward, but only once the last gradient is in:
# nothing is left of backward for the all-reduces to overlap.
AT_THE_END_OF_BACKWARD = """
class HookDDP:
    def __init__(self, model, bucket_cap_bytes):
        self.cap = bucket_cap_bytes
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.ready_ones, self.pending = [], []
        for p in self.params:
            p.register_post_accumulate_grad_hook(self.ready)

    def ready(self, p):
        self.ready_ones.append(p)
        if len(self.ready_ones) < len(self.params):
            return
        bucket, held = [], 0
        for q in self.ready_ones:
            bucket.append(q)
            held += q.grad.numel() * q.grad.element_size()
            if held >= self.cap:
                self.launch(bucket)
                bucket, held = [], 0
        if bucket:
            self.launch(bucket)
        self.ready_ones = []

    def launch(self, bucket):
        flat = torch.cat([q.grad.reshape(-1) for q in bucket])
        self.pending.append((dist.all_reduce(flat, async_op=True), flat, bucket))

    def finish(self):
        for work, flat, params in self.pending:
            work.wait()
            flat /= world_size
            offset = 0
            for q in params:
                q.grad.copy_(flat[offset : offset + q.grad.numel()].view_as(q.grad))
                offset += q.grad.numel()
        self.pending = []
"""


MISTAKES = {
    "forgot-to-divide": (_wrong(divide=""), "divide by the world size"),
    "no-overlap": (_wrong(full="False"), "no overlap: launch each bucket's all-reduce from the hook"),
    "synchronous-in-hook": (
        _wrong(launch="work = dist.all_reduce(flat)", wait=""),
        "synchronous (async_op=False) in step 1: it blocks backward",
    ),
    "waits-in-hook": (_wrong(launch="work = dist.all_reduce(flat, async_op=True); work.wait()"), "blocks backward"),
    "waits-on-the-future-in-hook": (
        _wrong(launch="work = dist.all_reduce(flat, async_op=True); work.get_future().wait()"),
        "waited on before backward returned in step 1 (work.get_future().wait() in a hook): that blocks backward",
    ),
    "barrier-in-hook": (
        _wrong(launch="work = dist.all_reduce(flat, async_op=True); dist.barrier()"),
        "waited on before backward returned in step 1 (dist.barrier() in a hook)",
    ),
    "launched-a-gradient-late": (
        # A bucket launched by the hook after the one that filled it: one gradient late.
        _wrong(full="False", before="if self.bucket_bytes >= self.cap: self.launch()"),
        "yet backward went on to the next gradient before its all-reduce was launched",
    ),
    "launched-at-the-end-of-backward": (AT_THE_END_OF_BACKWARD, "became ready in step 1"),
    "per-parameter": (_wrong(full="True"), "one all-reduce per parameter"),
    "hooks-twice": (_wrong(again="self.register()"), "gradients are reduced more than once a step"),
}
