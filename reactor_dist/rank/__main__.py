"""``python -m reactor_dist.rank``: one rank (:func:`reactor_dist.rank.server.main`), as
the runner starts it and as ``reactor-dist-rank`` runs it."""

from .server import leave, main

leave(main())
