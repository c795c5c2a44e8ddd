"""``reactor-dist doctor`` (``python -m reactor_dist doctor``) on this machine."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from reactor_dist.__main__ import main as cli
from reactor_dist.caller import doctor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_doctor(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "reactor_dist", "doctor", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONIOENCODING": "utf-8", **env})


def test_doctor_passes_on_this_machine_with_two_cpu_ranks():
    out = run_doctor("--device", "cpu", "--world-size", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "reactor-dist doctor: world_size=2, device=cpu"
    for name in ("shared memory", "CUDA_VISIBLE_DEVICES", "torch", "open files limit",
                 "locked memory limit", "CPU cores", "pidfd", "smoke run"):
        (row,) = [line for line in lines if line[2:].startswith(name + " ")]
        assert row[0] in "✓·", row
    assert any(line.startswith("✓ smoke run") and "16 MiB frame back" in line for line in lines)
    assert "✗" not in out.stdout and lines[-1] == "all checks passed"


def test_doctor_passes_with_one_rank_which_forms_no_group():
    # world_size 1 is the default on a 1-GPU machine; one rank forms no group, so the
    # smoke run must not call a collective.
    out = run_doctor("--device", "cpu", "--world-size", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "reactor-dist doctor: world_size=1, device=cpu"
    (row,) = [line for line in lines if line.startswith("✓ smoke run")]
    assert "1 rank on cpu: no torch group (one rank), a 16 MiB frame back" in row
    assert lines[-1] == "all checks passed"


def test_doctor_fails_on_a_small_dev_shm_and_prints_the_fix():
    out = run_doctor("--device", "cpu", "--world-size", "2",
                     REACTOR_DIST_SHM_LIMIT=str(64 << 20))
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    row = lines.index(next(line for line in lines if line.startswith("✗ shared memory")))
    assert "64 MiB" in lines[row]
    assert "fix:" in lines[row + 1] and "--shm-size=" in lines[row + 1]
    assert lines[-1] == "1 check failed"


def test_the_checks_alone():
    small = doctor.check_shm("/dev/shm", frame_bytes=1 << 40)  # a TiB frame: too big
    assert small.ok is False and "--shm-size" in small.fix
    assert doctor.check_shm("/nonexistent-dir", 1).ok is False
    cuda = doctor.check_gpus(64, "cuda")
    (gpus,) = [c for c in cuda if c.name == "GPUs"]
    import torch

    assert gpus.ok is False
    if torch.cuda.device_count():  # some GPUs, not 64
        assert gpus.fix.startswith(f"lower --world-size to {torch.cuda.device_count()}, ")
    else:  # none at all: never "lower --world-size to 0"
        assert gpus.fix.startswith("no GPU is visible: run with --device cpu, or make GPUs "
                                   "visible")
    assert doctor.check_pidfd().ok is True
    table = doctor.table([doctor.Check("a", True, "fine"),
                          doctor.Check("bb", False, "bad", "do x")])
    assert "fix: do x" in table and table.endswith("1 check failed")


def test_the_command_line(capsys):
    assert cli([]) == 2 and "usage: reactor-dist {doctor}" in capsys.readouterr().err
    assert cli(["nope"]) == 2 and "unknown command 'nope'" in capsys.readouterr().err
    assert cli(["--help"]) == 0 and "doctor" in capsys.readouterr().out


def test_device_auto_is_accepted_and_the_default_and_names_the_device_it_chose():
    # "auto" is the runner's default; doctor resolves it the way the ranks do.
    chosen = "cuda" if torch.cuda.is_available() else "cpu"
    sees = "a CUDA device" if chosen == "cuda" else "no CUDA device"
    first = (f"reactor-dist doctor: world_size=2, device={chosen} "
             f"(--device auto: torch sees {sees})")
    out = run_doctor("--device", "auto", "--world-size", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == first and lines[-1] == "all checks passed"
    assert any(line.startswith("✓ smoke run") and f"2 ranks on {chosen}:" in line
               for line in lines)
    default = run_doctor("--world-size", "2", "--no-smoke")  # no --device: auto
    assert default.stdout.splitlines()[0] == first, default.stdout + default.stderr


def test_cpu_ranks_need_a_core_each():
    cores = len(os.sched_getaffinity(0))
    s = "s" if cores != 1 else ""
    assert doctor.check_cores(cores, "cpu") == doctor.Check(
        "CPU cores", True, f"{cores} usable by this process, for {cores} rank{s} on cpu: "
        f"a core per rank")
    # On CUDA the GPUs compute: the cores are information only.
    assert doctor.check_cores(cores + 1, "cuda") == doctor.Check(
        "CPU cores", None, f"{cores} usable by this process, for {cores + 1} ranks "
        f"(they compute on GPUs)")
    out = run_doctor("--device", "cpu", "--world-size", str(cores + 1), "--no-smoke")
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    (row,) = [i for i, line in enumerate(lines) if line.startswith("✗ CPU cores ")]
    assert lines[row].split(None, 3)[3] == (
        f"{cores} usable by this process, for {cores + 1} ranks on cpu: they share the "
        f"cores (a slow start, slow calls)")
    assert lines[row + 1].strip() == (f"fix: lower --world-size to {cores}, or run the "
                                      f"ranks on GPUs (--device cuda)")
    assert lines[-1] == "1 check failed"


def test_the_sample_output_on_the_page_is_what_doctor_prints_now():
    """docs/seeing-inside-a-step.md's sample: the same header, the same checks in the
    same order, the same verdict; what each check found is this machine's."""
    from docs_pages import blocks

    (sample,) = [b.code for b in blocks("docs/seeing-inside-a-step.md")
                 if b.heading == "Checking a machine: doctor" and b.language == "text"]
    command, *shown = sample.strip().splitlines()
    assert command == "$ reactor-dist doctor --device cpu --world-size 2"
    out = subprocess.run([sys.executable, "-m", "reactor_dist", "doctor", "--device", "cpu",
                          "--world-size", "2"], capture_output=True, text=True, timeout=120)
    printed = out.stdout.strip().splitlines()

    def check(line: str) -> str:  # its mark and name: the table pads them with 2+ spaces
        return line.split("  ")[0]

    assert printed[0] == shown[0] and printed[-1] == shown[-1]
    assert [check(line) for line in printed[1:-1]] == [check(line) for line in shown[1:-1]]
