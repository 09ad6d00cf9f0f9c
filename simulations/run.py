"""Fleet simulation on Flower's Simulation Engine (issue 6) — not implemented yet.

Until the federation (issue 5) and simulation (issue 6) land, this script only says so and
exits with status 2; the engine can be exercised with ``omnidraft bench`` (see README).
"""

import sys


def main() -> int:
    print("error: the fleet simulation is not implemented yet (issues 5 and 6); "
          "run `omnidraft bench` for the cross-vocabulary engine", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
