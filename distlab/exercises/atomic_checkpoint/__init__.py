"""Exercise ``atomic-checkpoint``: A checkpoint save that survives a SIGKILL.

``task.py`` is what the learner reads and starts from (task, starter cell, hints); ``solution.py`` the
reference, the text of a ``%%ddp`` cell; ``grader.py`` its cases and how each is graded, run on the
grader's ranks; ``saver.py`` the process whose saves the grader kills, ``states.py`` the two states
it saves. Nothing is imported here: a rank imports ``grader`` alone.
"""
