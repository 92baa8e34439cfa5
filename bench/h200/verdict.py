"""One line from an evaluate JSON: the verdict, each workload's speedup (* significant)
and the guards that failed, with the first one's detail.

    python3 bench/h200/verdict.py RESULT.json
"""

import json
import sys

result = json.load(open(sys.argv[1]))
speedups = " ".join(f"{w['name']}={w['speedup']:.3f}{'*' if w.get('significant') else ''}"
                    for w in result["workloads"] if w.get("speedup"))
failed = [guard for guard in result["guards"] if guard["status"] == "fail"]
print(result["verdict"], speedups, *([f"| failed: {', '.join(g['name'] for g in failed)}: "
                                      f"{failed[0]['detail'][:240]}"] if failed else []))
