"""What the numbers were measured on: without it a results file cannot be compared."""

from __future__ import annotations

import os
import platform
import shutil
import socket
from importlib import metadata

import psutil


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def host() -> str:
    return socket.gethostname().split(".")[0] or "host"


def describe() -> str:
    shm = shutil.disk_usage("/dev/shm") if os.path.isdir("/dev/shm") else None
    shm_txt = f"{shm.total / 2**30:.0f} GiB /dev/shm" if shm else "no /dev/shm"
    import zmq

    return (f"{_cpu_model()}, {os.cpu_count()} CPU cores, "
            f"{psutil.virtual_memory().total / 2**30:.0f} GiB RAM, {shm_txt}; "
            f"{platform.system()} {platform.release()}; Python {platform.python_version()}, "
            f"numpy {_version('numpy')}, pyzmq {zmq.__version__} (libzmq {zmq.zmq_version()}), "
            f"msgpack {_version('msgpack')}, torch {_version('torch')}")
