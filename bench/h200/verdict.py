"""One line from an evaluate JSON: the verdict and each workload's speedup (* significant).

    python3 bench/h200/verdict.py RESULT.json
"""

import json
import sys

result = json.load(open(sys.argv[1]))
speedups = " ".join(f"{w['name']}={w['speedup']:.3f}{'*' if w.get('significant') else ''}"
                    for w in result["workloads"] if w.get("speedup"))
print(result["verdict"], speedups)
