"""The front: what a person uses, put together from the parts below it.

``lab.py`` is the ``Lab`` (the core, ``notebook.core.LabCore``, with its views attached: the side
panel's state file, progress bars, a healing cell's view, the telemetry store and dashboard, the class's
limits), ``distlab.start``, ``distlab.attach`` and ``distlab.current_lab``; ``profiling.py`` is
``lab.profile()``; ``magics.py`` is ``%dist``, ``%%ddp``, ``%quiz`` and ``%exercise``. This is the
one package that imports the core and its views and the quiz and exercises together: it sits above
them all, and none of them imports it (``tests/test_layers.py`` holds the packages to no circle).
"""
