"""A throwaway single-member etcd for tests: its own data folder and free loopback ports."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def unavailable() -> str | None:
    """Why no etcd can be started here (None: it can)."""
    if shutil.which("etcd") is None:
        return "no etcd binary (Debian: apt-get install etcd-server)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Etcd:
    """``start()`` / ``stop()`` (SIGKILL, like a lost host) keep the data folder and the ports, so a
    restarted etcd is the same cluster at the same URL."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.client, self.peer = _free_port(), _free_port()
        self.url = f"http://127.0.0.1:{self.client}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 20.0) -> Etcd:
        peer = f"http://127.0.0.1:{self.peer}"
        self.log = open(self.folder / "etcd.log", "ab")
        self.proc = subprocess.Popen(
            ["etcd", "--name", "kvlc-test", "--data-dir", str(self.folder / "data"),
             "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"kvlc-test={peer}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1) as r:
                    if b"true" in r.read():
                        return self
            except OSError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"etcd did not become healthy; see {self.folder / 'etcd.log'}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None
