"""One module per exercise: ``cases(world_size, seed)`` and ``grade(case, learner)`` (see ``rank.exercise``)."""
