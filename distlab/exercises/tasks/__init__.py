"""One module per exercise, each defining ``EXERCISE``: what the learner reads and starts from."""
