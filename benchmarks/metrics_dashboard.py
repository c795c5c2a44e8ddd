"""``python -m benchmarks.metrics_dashboard [--seconds N] [--out PNG]``: the Grafana
dashboard's queries (docs/grafana/reactor_dist.json) against a real Prometheus server,
drawn with matplotlib as docs/metrics_dashboard.png.

A runner makes calls of varied length (some raise, some stream, one crashes a rank and
is followed by ``restart()``) while a Prometheus server (Debian's ``prometheus``
binary, on 127.0.0.1, data in a temporary directory) scrapes ``reactor_dist.metrics.
serve()`` every second; each panel's queries are then read back through Prometheus's
HTTP API (``query_range``).  tests/test_prometheus_server.py uses the same helpers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "docs" / "grafana" / "reactor_dist.json"
PICTURE = ROOT / "docs" / "metrics_dashboard.png"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prometheus_binary() -> str | None:
    """The prometheus binary on PATH (``make prometheus`` installs Debian's)."""
    return shutil.which("prometheus")


class PrometheusServer:
    """A Prometheus server on 127.0.0.1 that scrapes ``target`` (host:port) every second;
    a context manager: on exit the server is stopped and its data directory removed."""

    def __init__(self, target: str, binary: str | None = None) -> None:
        self.binary = binary or prometheus_binary()
        if self.binary is None:
            raise FileNotFoundError("no prometheus binary on PATH: `make prometheus` "
                                    "installs Debian's package")
        self.target, self.port = target, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data: str | None = None
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> PrometheusServer:
        self.data = tempfile.mkdtemp(prefix="reactor-dist-prometheus-")
        config = os.path.join(self.data, "prometheus.yml")
        with open(config, "w") as f:
            f.write("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                    "scrape_configs:\n  - job_name: reactor_dist\n    static_configs:\n"
                    f"      - targets: ['{self.target}']\n")
        self.log = open(os.path.join(self.data, "prometheus.log"), "wb")
        self.proc = subprocess.Popen(
            [self.binary, f"--config.file={config}",
             f"--storage.tsdb.path={os.path.join(self.data, 'tsdb')}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            self.wait_ready(60)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited ({self.proc.returncode}):\n"
                                   f"{self.output()}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"prometheus not ready after {timeout} s:\n{self.output()}")

    def output(self) -> str:
        if self.data is None:
            return ""
        try:
            with open(os.path.join(self.data, "prometheus.log"), errors="replace") as f:
                return f.read()[-3000:]
        except OSError:
            return ""

    def __exit__(self, *exc_info: Any) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)
            self.proc = None
            self.log.close()
        if self.data is not None:
            shutil.rmtree(self.data, ignore_errors=True)
            self.data = None

    # -- the HTTP API ---------------------------------------------------------------------------
    def api(self, path: str, **params: Any) -> Any:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus answered {body} to {url}")
        return body["data"]["result"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """An instant query: [{"metric": {...}, "value": [t, "v"]}, ...]."""
        return self.api("query", query=expr, **({} if at is None else {"time": at}))

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0
                    ) -> list[dict]:
        return self.api("query_range", query=expr, start=start, end=end, step=step)

    def wait_for(self, expr: str, want: float, timeout: float = 30.0) -> float:
        """Query ``expr`` (one series) until Prometheus has scraped the value ``want``."""
        deadline = time.monotonic() + timeout
        got: list = []
        while time.monotonic() < deadline:
            got = self.query(expr)
            if got and float(got[0]["value"][1]) == want:
                return float(got[0]["value"][0])
            time.sleep(0.3)
        raise TimeoutError(f"{expr} did not reach {want} in {timeout} s: {got}\n"
                           f"{self.output()}")


def dashboard_panels(rate_interval: str, path: Path = DASHBOARD
                     ) -> list[tuple[str, list[tuple[str, str]]]]:
    """(panel title, [(query, legend format), ...]) of every panel of the dashboard, with
    Grafana's ``$__rate_interval`` replaced by ``rate_interval`` as Grafana would."""
    with open(path) as f:
        board = json.load(f)
    return [(panel["title"],
             [(t["expr"].replace("$__rate_interval", rate_interval), t.get("legendFormat", ""))
              for t in panel["targets"]])
            for panel in board["panels"] if panel.get("targets")]


def legend(metric: dict[str, str], fmt: str) -> str:
    for key, value in metric.items():
        fmt = fmt.replace("{{" + key + "}}", value).replace("{{ " + key + " }}", value)
    return fmt or ",".join(f"{k}={v}" for k, v in metric.items())


def draw(server: PrometheusServer, start: float, end: float, out: Path,
         rate_interval: str = "15s") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = dashboard_panels(rate_interval)
    cols = 3
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows), squeeze=False)
    for ax, (title, targets) in zip(axes.flat, panels, strict=False):
        for expr, fmt in targets:
            for series in server.query_range(expr, start, end):
                t = [float(p[0]) - start for p in series["values"]]
                v = [float(p[1]) for p in series["values"]]
                ax.plot(t, v, label=legend(series["metric"], fmt), linewidth=1.4)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("seconds", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle("reactor_dist dashboard (docs/grafana/reactor_dist.json) over a real "
                 "Prometheus: world_size 2, CPU, scraped every 1 s, "
                 f"$__rate_interval={rate_interval}", fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def workload(runner: Any, seconds: float, *, crash_at: float | None = None) -> None:
    """Calls of 5-60 ms on rank 0 (rank 1 quicker), a raise every 25th, a stream every
    10th; at ``crash_at`` seconds a crash of rank 1 and ``restart()``."""
    from reactor_dist import WorkerCrashed

    began, i = time.monotonic(), 0
    while time.monotonic() - began < seconds:
        i += 1
        if crash_at is not None and time.monotonic() - began >= crash_at:
            crash_at = None
            try:
                runner.generate("crash")
            except WorkerCrashed:
                pass
            time.sleep(3)  # the health panel shows the gap
            runner.restart()
        elif i % 25 == 0:
            try:
                runner.generate("raise")
            except ValueError:
                pass
        elif i % 10 == 0:
            list(runner.stream({"stream": 3}))
        else:
            runner.generate({"sleep": 0.005 + 0.055 * ((i * 7919) % 100) / 100})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.metrics_dashboard")
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--out", type=Path, default=PICTURE)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests"))
    from metrics_workers import Metered
    from prometheus_client import CollectorRegistry

    from reactor_dist import DistributedRunner, metrics

    registry = CollectorRegistry()
    with DistributedRunner(Metered, world_size=2, device="cpu",
                           init_process_group=False) as runner:
        handle = metrics.register(runner, registry, name="demo")
        http = metrics.serve(0, registry=registry)
        try:
            with PrometheusServer(f"127.0.0.1:{http.server_port}") as server:
                server.wait_for('reactor_dist_healthy{runner="demo"}', 1)
                start = time.time()
                workload(runner, args.seconds, crash_at=args.seconds / 2)
                time.sleep(3)  # the last scrapes
                draw(server, start, time.time(), args.out)
        finally:
            http.shutdown()
            http.server_close()
            metrics.unregister(handle)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
