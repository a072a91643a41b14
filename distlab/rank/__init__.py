"""What runs on a rank (an ipyparallel engine): identity, the process group, the cell (or a torchrun
script) and what torchrun code expects of a rank, release, the flight recorder. Nothing here imports
what runs in the notebook (``distlab.notebook``); the two talk only through data (``distlab.wire``)
and the calls ``distlab.notebook.rpc`` makes.
"""
