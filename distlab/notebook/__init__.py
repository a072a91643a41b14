"""What runs in the notebook's kernel: the lab's core and its collaborators, the cell run, diagnosis and recovery.

Nothing here imports what runs on a rank (``distlab.rank``) or torch: the ranks are driven through
``rpc``, the one module that names rank-side functions. Nor does anything here import a view, the
quiz, the exercises or ``distlab.front`` (the ``Lab`` with its views, and the magics): they import this.
"""
