"""A class on one server: JupyterHub with many learners, each with their own labs and nothing of another's.

- ``spawner``: how a learner's server starts (their own user, their own network namespace, the
  instructor's limits on cores);
- ``limits``: the instructor's limits that distlab itself enforces in a learner's kernel (ranks,
  labs, idle end), each refused with one line;
- ``hub``: the hub's configuration, in the fewest commands (``python -m distlab.classroom``);
- ``instructor``: the instructor's view, a hub service (every learner's labs and progress, Stop);
- ``assignment``: the exercises and quizzes as an nbgrader assignment, graded on live ranks.

Nothing here is imported by a lab unless a limit is set.
"""
