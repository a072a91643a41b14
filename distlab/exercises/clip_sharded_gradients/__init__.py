"""Exercise ``clip-sharded-gradients``: clip the gradients of a model FSDP2 shards, by the whole gradient's norm.

``task.py`` is what the learner reads and starts from (task, starter cell, hints); ``solution.py`` the
reference, the text of a ``%%ddp`` cell; ``grader.py`` its cases and how each is graded, run on the
grader's ranks. Nothing is imported here: a rank imports ``grader`` alone.
"""
