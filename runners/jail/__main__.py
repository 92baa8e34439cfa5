"""`python -s -m runners.jail PLAN_JSON REPORT_FD JUDGE_PID`: the supervisor, which starts
the jailed child (runners.jail.supervisor). Imports nothing of the harness nor torch."""

import sys

from runners.jail.supervisor import main

main(sys.argv)
