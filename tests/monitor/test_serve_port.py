"""``python -m cua_rl.monitor serve`` on a port that is taken, as every demo's closing line invites
(``serve ... --port 8765`` while the previous browse still serves there).

It used to print ``serving ... on :8765`` and the dashboard's URL, then uvicorn's ``address
already in use``, exit 3, having created and migrated the database. Now the port is bound
first: one ``monitor error:`` line saying what to do, exit 1, nothing created.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from cua_rl.serving import bind_free_port

ROOT = Path(__file__).resolve().parents[2]


def _serve(*argv: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "cua_rl.monitor", "serve", *argv],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **kw,
    )


def test_a_taken_port_is_one_line_and_nothing_created(tmp_path):
    holder = bind_free_port()
    holder.listen()  # a live server's socket, not one in TIME_WAIT
    port = holder.getsockname()[1]
    try:
        proc = _serve("--db", str(tmp_path / "m.db"), "--port", str(port))
        out, err = proc.communicate(timeout=120)
    finally:
        holder.close()
    assert proc.returncode == 1, err
    assert out == ""  # not announced as served
    assert err.splitlines() == [
        f"monitor error: port {port} on 127.0.0.1 is already in use: another monitor may serve "
        f"there (open http://127.0.0.1:{port}/), or another program holds it; stop it, or serve "
        "on another port: --port N (--port 0 picks a free one)"
    ]
    assert list(tmp_path.iterdir()) == []


def test_port_0_serves_on_the_free_port_it_announces(tmp_path):
    proc = _serve("--db", str(tmp_path / "m.db"), "--port", "0")
    try:
        first = proc.stdout.readline()
        assert first.startswith("monitor: serving "), first + proc.stderr.read()
        url = first.split(" on ", 1)[1].split()[0]
        assert not url.endswith(":0"), first
        # Bound before the line was printed; uvicorn serves on it once started (bounded wait).
        deadline = time.monotonic() + 60
        while True:
            try:
                assert httpx.get(f"{url}/healthz", timeout=1).status_code == 200
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
                time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # one that never started serving ignores SIGTERM
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
