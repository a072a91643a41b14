"""Drop saved widget state from a notebook's metadata (megabytes of plotly data): strip_widgets.py NB..."""
import sys
import nbformat
for path in sys.argv[1:]:
    nb = nbformat.read(path, as_version=4)
    nb.metadata.pop("widgets", None)
    nbformat.write(nb, path)
