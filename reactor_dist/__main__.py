"""``python -m reactor_dist <command>`` (also the ``reactor-dist`` console script).

Commands: ``doctor`` (:mod:`reactor_dist.caller.doctor`).
"""

from __future__ import annotations

import sys

COMMANDS = {"doctor": "check this machine, then a smoke run of its ranks "
                      "(reactor_dist.caller.doctor)"}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help") or args[0] not in COMMANDS:
        usage = "usage: reactor-dist {" + ",".join(COMMANDS) + "} [options]\n\ncommands:\n"
        usage += "".join(f"  {name:8s} {what}\n" for name, what in COMMANDS.items())
        if args and args[0] in ("-h", "--help"):
            sys.stdout.write(usage)
            return 0
        unknown = f"reactor-dist: unknown command {args[0]!r}\n" if args else ""
        sys.stderr.write(unknown + usage)
        return 2
    from .caller import doctor

    return doctor.main(args[1:])


if __name__ == "__main__":
    sys.exit(main())
