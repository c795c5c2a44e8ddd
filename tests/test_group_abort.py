"""The group's abort runs once per group, under one lock, whoever asks (issue 54): the
abort signal's thread and the REJOIN's leave_group ask at once in a restart; NCCL's
abort lasts long enough for both to be inside it.  Two real ranks on gloo ask both ways
many rounds and must end every round in one clean rejoin."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil

ROUNDS = 40
HERE = os.path.dirname(os.path.abspath(__file__))


def test_two_asks_at_once_abort_once_and_the_next_group_forms_every_round(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE])}
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "abort_race.py"), str(rank),
                               str(tmp_path), str(ROUNDS)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)
             for rank in range(2)]
    try:
        outputs = [proc.communicate(timeout=240) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [proc.returncode for proc in procs] == [0, 0], [err[-2000:] for _, err in outputs]
    for out, _ in outputs:
        said = json.loads(out.strip().splitlines()[-1])
        assert said == {"rounds": ROUNDS, "aborts": ROUNDS, "sums": [[3.0] * 4] * ROUNDS}
    assert not any(psutil.pid_exists(proc.pid) for proc in procs)
