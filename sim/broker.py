"""Mosquitto as a managed process: the fleet plane's broker for `sprinter simulate`, `sprinter fleet up` and tests.

It runs in the foreground on loopback with a generated config (no persistence; anonymous, or a
password file for the given users), and is stopped with the program that started it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

from sim.processes import free_port, wait_ready


def mosquitto_binary() -> str:
    """Debian's broker (`apt-get install -y mosquitto`; `make test` and `make demo-fleet` install it)."""
    path = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None)
    if path is None:
        raise FileNotFoundError("mosquitto is not installed: apt-get install -y mosquitto")
    return path


class MosquittoBroker:
    """`with MosquittoBroker(directory) as broker:` then `broker.url`; `stop()` / `start()` (faults, restarts)."""

    def __init__(self, directory: Path, port: int | None = None, users: dict[str, str] | None = None) -> None:
        self.binary = mosquitto_binary()
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.users = users or {}
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def _config(self) -> Path:
        lines = [f"listener {self.port} 127.0.0.1", "persistence false", "log_dest stderr",
                 "log_type error", "log_type warning"]
        if os.geteuid() == 0:  # else mosquitto drops to its own user, who cannot read the test's files
            lines.append("user root")
        if self.users:
            passwords = self.directory / "passwords"
            passwords.write_text("")
            for user, password in self.users.items():
                subprocess.run(["mosquitto_passwd", "-b", str(passwords), user, password], check=True)
            lines += ["allow_anonymous false", f"password_file {passwords}"]
        else:
            lines.append("allow_anonymous true")
        config = self.directory / "mosquitto.conf"
        config.write_text("\n".join(lines) + "\n")
        return config

    def start(self) -> None:
        self.process = subprocess.Popen([self.binary, "-c", str(self._config())], stdout=subprocess.DEVNULL,
                                        stderr=open(self.directory / "mosquitto.log", "ab"))
        wait_ready(self._listening, self.process, 10, 0.05,
                   lambda code: f"mosquitto exited: {(self.directory / 'mosquitto.log').read_text()[-500:]}",
                   "mosquitto did not open its port")

    def _listening(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
            return True
        except OSError:
            return False

    def stop(self, kill: bool = False) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            self.process.wait(timeout=10)
        self.process = None

    def __enter__(self) -> MosquittoBroker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
