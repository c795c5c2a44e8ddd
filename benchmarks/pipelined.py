"""``python -m benchmarks.pipelined [--quick]``: the "pipelined steps" rows of ``make
bench`` alone (see ``benchmarks/families/pipelined.py``): steps per second of an app
whose rank computes C ms and which works W ms per step, one at a time and with the next
step submitted ahead, against the bound 1 / max(C, W). Prints the table; writes nothing.
The same as ``python -m benchmarks.family pipelined``."""

from __future__ import annotations

import sys

from benchmarks import family


def main(argv: list[str] | None = None) -> int:
    return family.main(["pipelined", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
