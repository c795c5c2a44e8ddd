"""One rank of tests/test_group_abort.py: ``python tests/abort_race.py RANK DIR ROUNDS``.

Each round forms a gloo group (a FileStore of its own in DIR), checks an all_reduce,
then is asked to abort it twice at once, as a restart asks (reactor_dist.rank.group): the
abort signal (its thread) and ``leave_group`` (the REJOIN's, in this thread).  Even
rounds leave at once (whichever takes the signal first), odd rounds once the thread
has begun.  Prints one JSON line: rounds, aborts carried out, sums seen."""

from __future__ import annotations

import json
import os
import sys
import time

from reactor_dist.rank.group import Rendezvous, block_rank_signals, watch_abort
from reactor_dist.wire.protocol import GROUP_ABORT_SIGNAL, Bootstrap, WorkerRef


def main() -> None:
    rank, directory, rounds = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    block_rank_signals()  # before any thread, as a rank does
    import torch
    import torch.distributed as dist

    boot = Bootstrap(rank=rank, world_size=2, secret=b"", cmd_addr="", reply_addr="",
                     runner_pid=os.getppid(), shm_dir="", shm_prefix="",
                     worker=WorkerRef("x", "X"), load_kwargs=b"", init_process_group=True,
                     device="cpu", start_timeout=60.0, keep_free=0)
    rendezvous = Rendezvous(boot, directory)
    watch_abort(rendezvous)
    sums = []
    for epoch in range(rounds):
        rendezvous.epoch = epoch
        rendezvous.form_group("cpu", 0)
        t = torch.ones(4) * (rank + 1)
        dist.all_reduce(t)
        sums.append(t.tolist())
        os.kill(os.getpid(), GROUP_ABORT_SIGNAL)
        if epoch % 2:  # the thread has the lock (its abort began) before we ask
            give_up = time.monotonic() + 10.0
            while rendezvous.aborted != rendezvous.group and time.monotonic() < give_up:
                time.sleep(0.0001)
        rendezvous.leave_group("cpu")
    print(json.dumps({"rounds": rounds, "aborts": rendezvous.aborts, "sums": sums}), flush=True)


if __name__ == "__main__":
    main()
