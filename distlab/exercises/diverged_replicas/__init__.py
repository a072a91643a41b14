"""Exercise ``diverged-replicas``: find the parameters whose replicas differ across the ranks, by fingerprints.

``task.py`` is what the learner reads and starts from (task, starter cell, hints); ``solution.py`` the
reference, the text of a ``%%ddp`` cell; ``grader.py`` its cases and how each is graded, run on the
grader's ranks. Nothing is imported here: a rank imports ``grader`` alone.
"""
