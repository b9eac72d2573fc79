"""A JupyterLab server and a Chromium page driven by Playwright, for the notebook explorer's real-browser
test: the server runs on 127.0.0.1 with a token, from temporary config/data/runtime folders, and the
browser is the machine's own Chromium (no browser download)."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    """The browser to drive: $KVSCOPE_CHROMIUM, else the first Chromium or Chrome on the PATH."""
    chosen = os.environ.get("KVSCOPE_CHROMIUM")
    if chosen:
        return chosen if Path(chosen).exists() else None
    return next((path for name in CHROMIUM_NAMES if (path := shutil.which(name))), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def notebook(cells: list[str]) -> dict:
    """An nbformat-4 notebook of code cells."""
    return {"nbformat": 4, "nbformat_minor": 5, "metadata": {
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        "cells": [{"cell_type": "code", "id": f"cell{k}", "metadata": {}, "execution_count": None, "outputs": [],
                   "source": source} for k, source in enumerate(cells)]}


class JupyterLab:
    """`jupyter lab` on 127.0.0.1 serving `root`; stop() ends it. Its settings live under `home`."""

    def __init__(self, root: Path, home: Path, token: str = "kvscope-test-token") -> None:
        self.root, self.token, self.port = root, token, free_port()
        env = dict(os.environ)
        for name, sub in (("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_DATA_DIR", "data"),
                          ("JUPYTER_RUNTIME_DIR", "runtime"), ("JUPYTERLAB_WORKSPACES_DIR", "workspaces"),
                          ("IPYTHONDIR", "ipython")):
            env[name] = str(home / sub)
            (home / sub).mkdir(parents=True, exist_ok=True)
        # no news pop-up over the page
        (home / "config" / "labconfig").mkdir(parents=True, exist_ok=True)
        (home / "config" / "labconfig" / "page_config.json").write_text(json.dumps(
            {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}))
        self.log = open(home / "jupyter.log", "wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={self.port}",
             "--allow-root", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
             "--ServerApp.disable_check_xsrf=False"],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=root)
        self.log_path = home / "jupyter.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"jupyter lab exited ({self.process.returncode}):\n{self.log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/api/status?token={self.token}", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        raise TimeoutError(f"jupyter lab did not answer in {timeout_s:.0f} s:\n{self.log_path.read_text()[-3000:]}")

    def notebook_url(self, name: str) -> str:
        return f"{self.url}/lab/tree/{name}?token={self.token}"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()
