"""Entry points for tests/cpu/test_warm_start.py: what a forked worker or launcher runs in place
of AReaL's RPC server or the launcher's ``main`` (the zygote's ``--entry``), each saying what it
saw or doing one thing to its process. Each reads its instruction from ``WARM_TEST`` in its
environment."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

# Read while the module is imported: a zygote that preloads this module saw it read.
AT_IMPORT = os.environ.get("WARM_AT_IMPORT")


def run() -> None:
    what = os.environ.get("WARM_TEST", "report")
    if what == "report":
        line = sys.stdin.readline().strip()
        print(json.dumps({
            "argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("WARM_VALUE"),
            "late": os.environ.get("WARM_LATE"), "at_import": AT_IMPORT, "hash": hash("warm"),
            "stdin": line, "pid": os.getpid(), "ppid": os.getppid(),
            "sigterm": str(signal.getsignal(signal.SIGTERM)),
            "random": __import__("random").random(), "np": __import__("numpy").random.random(),
            "cmdline": __import__("psutil").Process().cmdline(),
        }), flush=True)  # fmt: skip
        print("to stderr", file=sys.stderr, flush=True)
    elif what == "exit":
        sys.exit(int(os.environ["WARM_CODE"]))
    elif what == "raise":
        raise RuntimeError("the worker's bug")
    elif what == "wait-for-sigterm":

        def stop(signum, _frame):
            print(f"got signal {signum}", flush=True)
            sys.exit(7)

        signal.signal(signal.SIGTERM, stop)
        print(f"ready {os.getpid()}", flush=True)
        while True:
            time.sleep(3600)
    elif what == "wait":
        print(f"ready {os.getpid()}", flush=True)
        while True:
            time.sleep(3600)
    elif what == "wait-with-child":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        print(f"ready {os.getpid()} {child.pid}", flush=True)
        while True:
            time.sleep(3600)
    elif what == "thread":
        # A non-daemon thread that ends only after the entry has returned (on a line in stdin).

        def finish():
            sys.stdin.readline()
            print("thread done", flush=True)

        threading.Thread(target=finish).start()
        print("entry returned", flush=True)
