"""The former name of :mod:`reactor_dist.rank`: ``python -m reactor_dist.launcher`` still
starts a rank's serve loop, for scripts and launch wrappers written against it."""

import sys

from .rank import RankServer, main

__all__ = ["RankServer", "main"]

if __name__ == "__main__":
    sys.exit(main())
