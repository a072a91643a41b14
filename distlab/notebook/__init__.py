"""What runs in the notebook's kernel: the Lab and the magics over it, the cell run, diagnosis and recovery.

Nothing here imports what runs on a rank (``distlab.rank``) or torch: the ranks are driven through
``rpc``, the one module that names rank-side functions.
"""
