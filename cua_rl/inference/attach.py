"""A training borrows a running inference server instead of starting one (``inference.server``).

Starting vLLM is most of a short training's start-up on CPU (about a minute of a tiny model's
three), and the same server can serve one training after another: what ties it to a training
is only the weights it holds and the version label they carry. ``POST /cua_rl/attach`` on
``cua_rl.inference.vllm_server`` loads the checkpoint the training starts from (``actor.path``),
clears the label (tokens then carry the training's initial version, as on a new server) and
lends the server to that training until its connection closes; a second training is refused
while the first holds it, and another model's path always is.

``python -m cua_rl.inference.attach HOST:PORT MODEL_PATH`` is that connection: it prints one
line, ``attached: ...`` or ``refused: ...``, and then holds the server until it is terminated
(exit 2 when refused, 1 when the server cannot be reached). In a rollout worker
``attach_process`` runs it where AReaL would start a server, and AReaL's tear-down, which stops
the servers it started, ends it: the server is given back, not stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import httpx

ROUTE = "/cua_rl/attach"
# How long a refusal because another training holds the server is retried: the previous
# training's hold ends when its processes do, which its tear-down may still be doing.
BUSY_WAIT_S = 60.0


class AttachError(RuntimeError):
    """The server refused the training or could not be reached; the message says why."""


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (``http://`` allowed) as a pair; ValueError naming the address otherwise."""
    bare = address.strip().removeprefix("http://").rstrip("/")
    host, sep, port = bare.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not host:port")
    return host, int(port)


def hold(address: str, model_path: str, who: str, out=sys.stdout) -> int:
    """Borrow the server and keep it until this process ends; prints the outcome line."""
    host, port = split_address(address)
    url = f"http://{host}:{port}{ROUTE}"
    deadline = time.monotonic() + BUSY_WAIT_S
    body = {"model_path": model_path, "who": who}
    while True:
        try:
            with httpx.Client(timeout=httpx.Timeout(600.0, read=None)) as client:
                with client.stream("POST", url, json=body) as resp:
                    if resp.status_code == 409 and time.monotonic() < deadline:
                        resp.read()
                        time.sleep(1.0)
                        continue
                    lines = resp.iter_lines()
                    first = next(lines, "")
                    answer = _json(first)
                    if resp.status_code != 200 or not answer.get("success"):
                        print(f"refused: {answer.get('message') or first}", file=out, flush=True)
                        return 2
                    print(f"attached: {address} {answer['message']}", file=out, flush=True)
                    for _ in lines:  # keep-alive lines, until the server or this process ends
                        pass
                    print(f"the server at {address} closed the connection", file=out, flush=True)
                    return 1
        except httpx.HTTPError as exc:
            print(
                f"refused: the server at {address} cannot be reached: {exc}", file=out, flush=True
            )
            return 1


def _json(line: str) -> dict:
    try:
        value = json.loads(line)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def attach_process(address: str, model_path: str) -> subprocess.Popen:
    """Start the hold in a child process and return it once the server is lent to it; raises
    ``AttachError`` with the server's reason when it is not."""
    who = f"pid {os.getpid()} on {socket.gethostname()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "cua_rl.inference.attach", address, model_path, "--who", who],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    first = proc.stdout.readline().strip()
    if not first.startswith("attached: "):
        rest = proc.stdout.read()
        proc.wait()
        raise AttachError(f"inference.server={address}: {first} {rest}".strip())
    return proc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cua_rl.inference.attach", description=__doc__)
    parser.add_argument("address", help="the server, host:port")
    parser.add_argument("model_path", help="the checkpoint the training starts from (actor.path)")
    parser.add_argument("--who", default="", help="named in the refusal another training gets")
    args = parser.parse_args(argv)
    try:
        return hold(args.address, args.model_path, args.who or f"pid {os.getpid()}")
    except ValueError as exc:
        print(f"refused: {exc}", flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
