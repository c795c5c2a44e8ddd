"""Every rank starts with reactor_dist's environment defaults (reactor_dist/placement/rank_env.py)
unless the caller's environment or the runner's ``env=`` sets the variable; and the
default takes effect: a fresh 97 MB buffer in a rank faults in huge pages (issue 43)."""

from __future__ import annotations

import pytest
from rank_env_workers import NBYTES, VARIABLE, AllocationProbe, EnvOf

from benchmarks.cpu_copy_settings import transparent_huge_pages
from reactor_dist import DistributedRunner
from reactor_dist.placement.local import RANK_START_ENV
from reactor_dist.placement.rank_env import RANK_ENV_DEFAULTS

SMALL_PAGES = NBYTES // 4096  # first-touch faults of the buffer in 4 KiB pages, at least
# How a rank is started: forked from a template without torch, from one with torch
# imported (a torch group), or spawned.
STARTS = {"forked": ("fork", False), "forked with torch": ("fork", True),
          "spawned": ("spawn", False)}


def probe(monkeypatch, start: str, **kw) -> tuple[str | None, int]:
    how, group = STARTS[start]
    monkeypatch.setenv(RANK_START_ENV, how)
    with DistributedRunner(AllocationProbe, world_size=1, device="cpu",
                           init_process_group=group, **kw) as runner:
        return runner.generate(None)


NCCL_ERRORS = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def test_the_defaults_are_huge_pages_and_nccl_errors_left_to_the_runner():
    assert RANK_ENV_DEFAULTS == {VARIABLE: "1", NCCL_ERRORS: "0"}


@pytest.mark.parametrize("start", list(STARTS))
def test_a_rank_has_the_default_and_its_fresh_buffer_faults_in_huge_pages(monkeypatch, start):
    monkeypatch.delenv(VARIABLE, raising=False)
    value, faults = probe(monkeypatch, start)
    off_value, off_faults = probe(monkeypatch, start, env={VARIABLE: "0"})
    assert (value, off_value) == ("1", "0")
    assert off_faults >= SMALL_PAGES  # every 4 KiB page of the buffer, once
    if transparent_huge_pages() == "never":
        pytest.skip("the kernel's transparent huge pages are off: no effect to see")
    assert faults < SMALL_PAGES // 10  # 2 MB pages: ~47, and the 4 KiB pages at the ends


@pytest.mark.parametrize("start", ["forked with torch", "spawned"])
def test_the_callers_environment_and_the_runners_env_win(monkeypatch, start):
    monkeypatch.setenv(VARIABLE, "0")
    assert probe(monkeypatch, start)[0] == "0"
    assert probe(monkeypatch, start, env={VARIABLE: "2"})[0] == "2"


@pytest.mark.parametrize("start", ["forked with torch", "spawned"])
def test_every_rank_leaves_nccl_errors_to_the_runner_unless_the_application_says(
        monkeypatch, start):
    """Issue 54: NCCL's watchdog must not end the survivors before a restart's abort;
    an application that sets the variable (its environment, or env=) keeps its value."""
    monkeypatch.setenv(RANK_START_ENV, STARTS[start][0])

    def values(**kw) -> list:
        with DistributedRunner(EnvOf, world_size=2, device="cpu", **kw) as runner:
            return runner.call_all("value_of", NCCL_ERRORS)

    monkeypatch.delenv(NCCL_ERRORS, raising=False)
    assert values() == ["0", "0"]
    assert values(env={NCCL_ERRORS: "1"}) == ["1", "1"]
    monkeypatch.setenv(NCCL_ERRORS, "3")
    assert values() == ["3", "3"]
