"""Warm worker starts for CPU runs: AReaL's workers as forks of one process that has imported
what they import.

Every AReaL worker of a CPU run spends its first ~12 CPU seconds importing the same modules
(AReaL, torch, transformers, the model's classes) before it does anything, and a training starts
two or three of them; on a 2-core machine that is most of a short training's cost. Under the
local scheduler the trainer starts one *zygote* per run (``Zygote``: ``python -m
cua_rl.cpu.warm_start``). The scheduler still starts each worker as ``python -m
cua_rl.cpu.rpc_worker ARGS``; that process, the *stand-in*, connects to the zygote (the Unix
socket named by ``CUA_RL_ZYGOTE``) and hands it its argv, environment, working directory and
standard streams. At the first request the zygote becomes that worker's interpreter: it execs
itself in the worker's environment and directory (so what acts when a process starts, such as
``PYTHONHASHSEED`` and the ``LD_PRELOAD`` of AReaL's ``stdbuf``, and whatever the modules read
while they load, is what a worker started cold gets), imports the worker modules once, then forks
a worker per request. The fork applies the request's
environment, directory, arguments and streams, resets the signal handlers, reseeds NumPy's
global generator (Python's reseeds itself at a fork) and runs the worker's entry point as the
cold process would. The stand-in stays for the worker's life: it forwards SIGTERM, SIGINT and
SIGHUP to it, and exits with its status (by the same signal where the worker died of one); if
the stand-in is killed the worker kills itself (it watches the connection), so stopping the
stand-in, as AReaL's scheduler does, stops the worker.

A request whose environment differs from the first one's is answered "cold" (the stand-in runs
the worker itself and its log says why) unless every differing variable is the shell's own
(``SHELL_VARS``) or one the workers read when they use it (``LATE_VARS``: the rollout worker's
server and interpreter), and the zygote saw no import read it: it records every variable read
through ``os.environ`` while it imports, so a late variable an import starts reading makes its
workers start cold, named, instead of forking with the first worker's value baked in. A zygote
that fails or ends fails the stand-ins waiting on it with its reason; nothing falls back
silently. Ray and Slurm runs do not use it (their workers are not started by the
local scheduler's command).

The same zygote serves the launcher itself where a process runs many trainings (the test
suite): ``python -m examples.cua_agent.train`` stands in for a fork of the zygote that
``CUA_RL_TRAINER_ZYGOTE`` names (``hand_over``), which imported the launcher's modules
(``TRAINER_PRELOAD``) once. A fork leads a process group of its own, which it takes down when
its stand-in goes: what a kill of the stand-in's group does to a process started cold and to its
children. A trainer's fork also waits for its threads before its exit handlers, as the
interpreter does at exit.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import importlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from cua_rl.errors import CuaRlError
from cua_rl.inference.launch import ENV_SERVER, ENV_VLLM_PYTHON

ENV_ZYGOTE = "CUA_RL_ZYGOTE"
ENV_TRAINER_ZYGOTE = "CUA_RL_TRAINER_ZYGOTE"
# The worker's entry point in a fork (what ``python -m cua_rl.cpu.rpc_worker`` runs cold).
ENTRY = "cua_rl.cpu.rpc_worker:run_worker"
# What every worker imports before it serves (the actor's engine and the rollout's workflow
# included): about 12 CPU seconds on this project's machine kind.
PRELOAD = (
    "areal",
    "areal.infra.rpc.rpc_server",
    "areal.engine.fsdp_engine",
    "cua_rl.areal.worker",
    "cua_rl.areal.actor",
    "cua_rl.areal.logits_engine",
    "cua_rl.cpu.training",
    "cua_rl.rollout.workflow",
)
# What the launcher (``python -m examples.cua_agent.train``) has imported when its ``main`` starts,
# about 10 CPU seconds, and the function its fork runs.
TRAINER_PRELOAD = ("cua_rl.app.train",)
TRAINER_ENTRY = "cua_rl.app.train:cli"
# The model family's modules a worker loads (transformers.models.<type>.<kind>_<type>).
MODEL_MODULES = ("modeling", "processing", "image_processing", "video_processing")
# Set by the shell that AReaL's scheduler starts each worker through, different per process.
SHELL_VARS = frozenset({"_", "SHLVL", "PWD", "OLDPWD"})
# Read by a worker when it uses them, not at start: the trainer gives the rollout workers the
# server to borrow and the server's interpreter (cua_rl/inference/launch.py), not the actor.
LATE_VARS = frozenset({ENV_SERVER, ENV_VLLM_PYTHON})
# The signals a stand-in passes on to its worker.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
MAX_MESSAGE = 1 << 20
STOP_GRACE_S = 10.0
READY = "warm-start zygote listening"


class WarmStartError(CuaRlError, RuntimeError):
    """The zygote could not start a worker (it failed, ended, or answered out of protocol)."""


def _send(sock: socket.socket, message: dict, fds: list[int] = ()) -> None:
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def _receive(sock: socket.socket) -> dict | None:
    data = sock.recv(MAX_MESSAGE)
    return json.loads(data) if data else None


# -- the stand-in (the process the scheduler started) ---------------------------------------------


def hand_over(variable: str, role: str) -> None:
    """Where ``variable`` names a zygote, have it run this process's work (its arguments,
    environment and streams) and end as that fork ends; returns where none is named, or where
    the zygote says to start cold."""
    address = os.environ.get(variable)
    if address:
        code = run_forked(sys.argv, address, role)
        if code is not None:
            exit_like(code)


def run_forked(argv: list[str], address: str, role: str = "worker") -> int | None:
    """Have the zygote at ``address`` run this worker; the worker's exit code (negative: the
    signal that ended it), or None when the zygote says to start cold (its reason printed)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(address)
    except OSError as exc:
        raise WarmStartError(f"cannot reach the warm-start zygote at {address}: {exc}") from exc
    cmdline = Path("/proc/self/cmdline").read_bytes().decode(errors="replace").rstrip("\0")
    request = {
        "argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "cmdline": cmdline.split("\0"),
    }  # fmt: skip
    _send(sock, request, [0, 1, 2])
    answer = _receive(sock)
    if answer is None:
        raise WarmStartError(
            f"the warm-start zygote ended before starting this {role} (see its output)"
        )
    if "cold" in answer:
        print(f"[warm-start] cold start: {answer['cold']}", flush=True)
        return None
    if "error" in answer:
        raise WarmStartError(
            f"the warm-start zygote could not start this {role}: {answer['error']}"
        )
    pid = int(answer["pid"])
    print(f"[warm-start] {role} forked from the zygote: pid {pid}", flush=True)

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    done = _receive(sock)
    if done is None:
        # The zygote ended with the worker still running: stop it rather than leave it behind.
        forward(signal.SIGKILL, None)
        raise WarmStartError(f"the warm-start zygote ended while {role} {pid} ran; it was killed")
    return int(done["exit"])


def exit_like(code: int) -> None:
    """End this process as the worker ended: its exit code, or killed by its signal."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # these have no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 128 - code)


# -- the zygote -----------------------------------------------------------------------------------


def _env_difference(first: dict[str, str], env: dict[str, str], late: frozenset[str]) -> list[str]:
    keys = (set(first) | set(env)) - SHELL_VARS - late
    return sorted(k for k in keys if first.get(k) != env.get(k))


class _ReadRecorder(type(os.environ)):
    """``os.environ`` over the same variables, noting the name of every one read (``[]``,
    ``get``, ``in``, ``os.getenv``)."""

    def __init__(self, real: os._Environ):
        super().__init__(real._data, real.encodekey, real.decodekey, real.encodevalue,
                         real.decodevalue)  # fmt: skip
        self.read: set[str] = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)


def model_modules(model_dir: str) -> list[str]:
    """transformers' modules of the model family in ``model_dir`` (its config.json's
    ``model_type``) that exist: the model classes and the processors a worker loads."""
    import importlib.util

    try:
        model_type = json.loads((Path(model_dir) / "config.json").read_text())["model_type"]
    except (OSError, ValueError, KeyError):
        return []
    package = f"transformers.models.{model_type}"
    names = [f"{package}.{kind}_{model_type}" for kind in MODEL_MODULES]
    return [n for n in names if importlib.util.find_spec(n) is not None]


class _Server:
    def __init__(
        self, address: str, preload: tuple[str, ...], entry: str, model: str = "",
        late: frozenset[str] = LATE_VARS, argv: list[str] = (), listen_fd: int | None = None,
        role: str = "worker",
    ):  # fmt: skip
        self.address, self.preload, self.entry, self.model = address, preload, entry, model
        self.late, self.argv, self.role = late, list(argv), role
        if listen_fd is None:
            self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self.listener.bind(address)
            self.listener.listen(64)
        else:  # the image before the exec bound it
            os.set_inheritable(listen_fd, False)
            self.listener = socket.socket(fileno=listen_fd)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.first_env: dict[str, str] | None = None
        self.first_cwd = ""
        self.read_at_import: frozenset[str] = frozenset()
        self.children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, connection)
        self.stopping = False
        self.kill_at = float("inf")

    def become_first(self, conn: socket.socket, request: dict, fds: list[int]) -> None:
        """Exec this zygote in the first request's environment and directory, the request
        (its connection and streams included) handed over to the new image, which answers it."""
        pending = Path(self.address).parent / "pending.json"
        keep = [self.listener.fileno(), conn.fileno(), *fds]
        for fd in keep:
            os.set_inheritable(fd, True)
        pending.write_text(json.dumps({"request": request, "fds": keep[1:]}))
        os.chdir(request["cwd"])
        sys.stdout.flush()
        sys.stderr.flush()
        argv = [sys.executable, "-m", "cua_rl.cpu.warm_start", *self.argv,
                "--listen-fd", str(self.listener.fileno()), "--pending", str(pending)]  # fmt: skip
        try:
            os.execve(sys.executable, argv, request["env"])
        except OSError as exc:
            _send(conn, {"error": f"the zygote could not exec in the worker's environment: {exc}"})
            raise

    def answer_pending(self, path: str) -> None:
        """The first request, handed over by the image before the exec."""
        pending = json.loads(Path(path).read_text())
        Path(path).unlink()
        fd, *fds = pending["fds"]
        for each in (fd, *fds):
            os.set_inheritable(each, False)
        self.answer(socket.socket(fileno=fd), pending["request"], fds)

    def load(self, request: dict) -> None:
        """Import the worker modules (this process started as the first worker would)."""
        env = request["env"]
        t0, c0 = time.monotonic(), time.process_time()
        # The recorder shares the real mapping's variables: swapping it in changes nothing else.
        real = os.environ
        os.environ = recorder = _ReadRecorder(real)  # noqa: B003
        try:
            for name in self.preload:
                importlib.import_module(name)
            # Only where the family's package is there (transformers imported above).
            names = [*self.preload, *(model_modules(self.model) if self.model else [])]
            for name in names[len(self.preload) :]:
                importlib.import_module(name)
        finally:
            os.environ = real  # noqa: B003
        print(
            f"[warm-start] zygote imported {len(names)} modules ({len(sys.modules)} in all) "
            f"in {time.monotonic() - t0:.1f} s, {time.process_time() - c0:.1f} CPU s",
            flush=True,
        )
        self.read_at_import = frozenset(recorder.read)
        self.first_env, self.first_cwd = env, request["cwd"]

    def serve(self) -> None:
        while not (self.stopping and not self.children):
            if self.stopping and time.monotonic() > self.kill_at:
                self.signal_children(signal.SIGKILL)
            for key, _ in self.selector.select(timeout=1.0):
                if key.data == "accept":
                    conn, _ = self.listener.accept()
                    self.selector.register(conn, selectors.EVENT_READ, "request")
                elif key.data == "request":
                    self.selector.unregister(key.fileobj)
                    self.request(key.fileobj)
                else:
                    self.reap(key.fd)

    def request(self, conn: socket.socket) -> None:
        try:
            data, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 3)
        except OSError:
            conn.close()
            return
        if not data or len(fds) != 3:
            for fd in fds:
                os.close(fd)
            conn.close()
            return
        request = json.loads(data)
        if self.first_env is None and not self.stopping:
            self.become_first(conn, request, fds)  # does not return
        self.answer(conn, request, fds)

    def answer(self, conn: socket.socket, request: dict, fds: list[int]) -> None:
        try:
            if self.stopping:
                _send(conn, {"error": "the zygote is stopping: its training is ending"})
                conn.close()
                return
            if self.first_env is None:
                try:
                    self.load(request)
                except BaseException as exc:
                    _send(conn, {"error": f"importing the worker modules failed: {exc!r}"})
                    raise
            if request["cwd"] != self.first_cwd:
                _send(conn, {"cold": f"its working directory differs from the first {self.role}'s"})
                conn.close()
                return
            late = self.late - self.read_at_import
            differs = _env_difference(self.first_env, request["env"], late)
            if differs:
                named = [f"{k} (read while the zygote imported)" if k in self.late else k
                         for k in differs]  # fmt: skip
                _send(conn, {"cold": f"its environment differs from the first {self.role}'s in "
                             + ", ".join(named)})  # fmt: skip
                conn.close()
                return
            self.fork(conn, request, fds)
        finally:
            for fd in fds:
                os.close(fd)

    def fork(self, conn: socket.socket, request: dict, fds: list[int]) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                code = self.become_worker(conn, request, fds)
            except BaseException:
                traceback.print_exc()
                code = 1
            exit_like(code)
        pidfd = os.pidfd_open(pid)
        self.children[pidfd] = (pid, conn)
        self.selector.register(pidfd, selectors.EVENT_READ, "child")
        _send(conn, {"pid": pid})

    def become_worker(self, conn: socket.socket, request: dict, fds: list[int]) -> int:
        for signum in (signal.SIGTERM, signal.SIGCHLD, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        # Its children in its group, as a cold start's are in its stand-in's: _die_with ends
        # them all, as a kill of the stand-in's group would.
        os.setpgid(0, 0)
        self.selector.close()
        self.listener.close()
        for pidfd, (_, other) in self.children.items():
            os.close(pidfd)
            other.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.argv = list(request["argv"])
        # ps, psutil and the run's process checks see the worker under the stand-in's command
        # line (its role and port), not the zygote's.
        show_as(request["cmdline"])
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        # A stand-in that is killed takes its worker with it.
        threading.Thread(
            target=_die_with, args=(conn,), name="warm-start-watch", daemon=True
        ).start()
        module, _, function = self.entry.partition(":")
        run: Callable[[], object] = getattr(importlib.import_module(module), function)
        try:
            run()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if not isinstance(exc.code, (int, type(None))):
                print(exc.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
        if self.role == "trainer":
            # The interpreter waits for non-daemon threads before its exit handlers; a worker's
            # fork has always ended without (AReaL's scheduler stops its workers).
            threading._shutdown()
        atexit._run_exitfuncs()
        return code

    def reap(self, pidfd: int) -> None:
        pid, conn = self.children.pop(pidfd)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        try:
            _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
        except OSError:
            pass  # its stand-in is gone (it was killed, and the worker with it)
        conn.close()

    def stop(self, *_args) -> None:
        """Stop taking requests; end the workers still running (their trainer has gone):
        SIGTERM, then SIGKILL after ``STOP_GRACE_S``."""
        if not self.stopping:
            self.stopping = True
            self.kill_at = time.monotonic() + STOP_GRACE_S
            self.signal_children(signal.SIGTERM)

    def signal_children(self, signum: int) -> None:
        for pid, _ in self.children.values():
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass


def show_as(args: list[str]) -> None:
    """Make this process's command line (/proc/self/cmdline: what ps and psutil read) ``args``.

    Written over the process's original argument and environment strings (their addresses are
    in /proc/self/stat), which nothing reads once ``os.environ`` has been replaced (Python copies
    what it sets). Space-separated and NUL-terminated, with the last byte of the original
    arguments not NUL: the kernel then reads the line up to its NUL, as for setproctitle(3), and
    psutil splits it at the spaces (arguments with spaces in them come back split)."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    # Fields 48-51 of proc(5): arg_start, arg_end, env_start, env_end (this list starts at 3).
    arg_start, arg_end, env_start, env_end = (int(f) for f in fields[45:49])
    end = env_end if env_start == arg_end else arg_end
    title = " ".join(args).encode()[: end - arg_start - 1] + b"\0"
    ctypes.memmove(arg_start, title, len(title))
    if arg_start + len(title) < arg_end:
        ctypes.memset(arg_end - 1, ord("."), 1)


def _die_with(conn: socket.socket) -> None:
    try:
        while conn.recv(1):
            pass
    except OSError:
        pass
    os.killpg(0, signal.SIGKILL)  # this process's group: it and the children it started


def _die_with_parent() -> None:
    """SIGTERM when the trainer that started the zygote dies, however it dies."""
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="The warm-start zygote of a CPU run's AReaL workers, or of its launcher."
    )
    ap.add_argument("--role", default="worker", help="what it forks: worker or trainer")
    ap.add_argument("address", help="the Unix socket to listen on")
    ap.add_argument("--parent", type=int, required=True, help="its starter's pid (it ends with it)")
    ap.add_argument("--preload", default=",".join(PRELOAD), help="modules to import once")
    ap.add_argument("--entry", default=ENTRY, help="module:function a forked worker runs")
    ap.add_argument("--model", default="", help="the model folder whose classes to import too")
    ap.add_argument(
        "--late", default=",".join(sorted(LATE_VARS)),
        help="variables workers may differ in, unless an import read them",
    )  # fmt: skip
    ap.add_argument("--listen-fd", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--pending", help=argparse.SUPPRESS)
    raw = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(raw)
    _die_with_parent()
    if os.getppid() != args.parent:
        return 1  # the trainer died before the line above
    preload = tuple(filter(None, args.preload.split(",")))
    late = frozenset(filter(None, args.late.split(",")))
    server = _Server(
        args.address, preload, args.entry, args.model, late, raw, args.listen_fd, args.role
    )
    signal.signal(signal.SIGTERM, server.stop)
    if args.pending is None:
        print(f"{READY} at {args.address}", flush=True)
    try:
        if args.pending is not None:
            server.answer_pending(args.pending)
        server.serve()
    finally:
        # Its socket and folder go with it, whether or not its trainer lived to remove them.
        Path(args.address).unlink(missing_ok=True)
        try:
            Path(args.address).parent.rmdir()
        except OSError:
            pass  # not empty, or removed by the trainer already
    return 0


# -- the trainer's side ---------------------------------------------------------------------------


def start_workers_warm(warm: bool, model: str = "") -> str | None:
    """Where this run's workers start from: a zygote of its own (started here), the one
    ``CUA_RL_ZYGOTE`` already names (a process that runs many trainings, such as the test suite,
    shares one: workers whose environment differs from its first worker's start cold, named),
    or, with ``warm`` false, none. Its address, or None."""
    given = os.environ.get(ENV_ZYGOTE)
    if not warm:
        os.environ.pop(ENV_ZYGOTE, None)
        return None
    if given:
        if not Path(given).is_socket():
            raise WarmStartError(
                f"{ENV_ZYGOTE}={given}: no zygote listens there; unset it (this run then starts "
                "its own) or start the one it names first"
            )
        print(f"[warm-start] workers start from the zygote at {given} ({ENV_ZYGOTE})", flush=True)
        return given
    return Zygote(model=model).start().address


class Zygote:
    """The zygote of one run, started by its trainer: ``start()`` sets ``CUA_RL_ZYGOTE`` in this
    process's environment, which the scheduler's workers inherit; it stops at exit."""

    def __init__(
        self, *, model: str = "", preload: tuple[str, ...] = PRELOAD, entry: str = ENTRY,
        late: frozenset[str] = LATE_VARS, role: str = "worker",
    ):  # fmt: skip
        self.model, self.preload, self.entry, self.late = model, preload, entry, late
        self.role = role
        self.proc: subprocess.Popen | None = None
        self.address = ""
        self._dir: tempfile.TemporaryDirectory | None = None

    def start(self, timeout: float = 60.0, export: bool = True) -> Zygote:
        """Start it; with ``export``, this process's workers (its environment) start from it."""
        # The zygote removes it when it ends; the trainer, when it stops the zygote.
        self._dir = tempfile.TemporaryDirectory(prefix="cua-zygote-", ignore_cleanup_errors=True)
        self.address = str(Path(self._dir.name) / "zygote.sock")
        argv = [sys.executable, "-m", "cua_rl.cpu.warm_start", self.address,
                "--parent", str(os.getpid()), "--preload", ",".join(self.preload),
                "--entry", self.entry, "--model", self.model,
                "--late", ",".join(sorted(self.late)), "--role", self.role]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith(READY):
            code = self.proc.wait(timeout=timeout)
            raise WarmStartError(f"the warm-start zygote did not start (exit {code}): {line!r}")
        # Its later lines (what it imported) go where the trainer's own output goes.
        threading.Thread(target=self._relay, name="warm-start-zygote", daemon=True).start()
        if export:
            os.environ[ENV_ZYGOTE] = self.address
        atexit.register(self.stop)
        return self

    def _relay(self) -> None:
        for line in self.proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()

    def stop(self, timeout: float = 30.0) -> None:
        if os.environ.get(ENV_ZYGOTE) == self.address:
            del os.environ[ENV_ZYGOTE]
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None


if __name__ == "__main__":
    sys.exit(main())
