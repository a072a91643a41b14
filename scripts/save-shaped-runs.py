"""Write notebooks/saved/<notebook>.json from each network notebook's saved outputs (distlab.notebook.saved).

Run after re-executing a notebook that calls ``saved_from_nodes`` on a machine that makes emulated
nodes: a notebook run on loopback is refused (its cells would save loopback numbers as a shaped run's).

    .venv/bin/python scripts/save-shaped-runs.py [NOTEBOOK.ipynb ...]   (default: every notebook that uses it)
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from distlab.notebook.saved import MARK, extract

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
_USES = re.compile(r"""saved_from_nodes\(\s*["']([^"']+)["']""")


def users() -> dict[str, Path]:
    """{saved name: notebook} for every notebook whose cells call saved_from_nodes."""
    found = {}
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        for name in _USES.findall("\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")):
            found[name] = path
    return found


def main(argv: list[str]) -> int:
    wanted = {Path(a).resolve() for a in argv}
    for name, path in users().items():
        if wanted and path.resolve() not in wanted:
            continue
        texts = extract(path)
        if any(MARK in text for text in texts.values()):
            print(f"{path.name} was run without nodes (its cells show saved lines): run it where nodes can be made",
                  file=sys.stderr)
            return 1
        out = NOTEBOOKS / "saved" / f"{name}.json"
        out.write_text(json.dumps(texts, indent=1, ensure_ascii=False) + "\n")
        print(f"{out.relative_to(NOTEBOOKS.parent)}: {len(texts)} cells")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
