"""Print a notebook's code cells and their outputs, briefly: show.py notebooks/01-*.ipynb"""
import json, sys
nb = json.load(open(sys.argv[1]))
print("metadata keys:", list(nb["metadata"]), "size", len(json.dumps(nb)))
for i, c in enumerate(nb["cells"]):
    if c["cell_type"] != "code":
        continue
    src = "".join(c["source"])
    print(f"--- [{i}] {src[:70]!r}")
    for o in c["outputs"]:
        if o["output_type"] == "stream":
            print("   ", o["name"], "".join(o["text"])[:2000])
        elif o["output_type"] in ("display_data", "execute_result"):
            print("   ", list(o["data"]), str(o["data"].get("text/plain", ""))[:1200])
        else:
            print("   ", o["output_type"], o.get("ename"), str(o.get("evalue"))[:1500])
