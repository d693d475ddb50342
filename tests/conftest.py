"""Fixtures shared by every test area: tiny local models and real vLLM CPU servers.

Models are built once into the repository's cache (``.cache/models``, or ``$CUA_RL_CACHE``) and
reused across sessions; servers are started once per session on free loopback ports and stopped
by process group at the end.
"""

from __future__ import annotations

import pytest

from cua_rl.testing.models import ensure_model
from cua_rl.testing.vllm_server import VLLMServer


@pytest.fixture(scope="session")
def tiny_vl_model_dir():
    """Tiny random Qwen2-VL with the byte-only tokenizer (prefix property holds on ASCII)."""
    return ensure_model("qwen2-vl-byte")


@pytest.fixture(scope="session")
def tiny_vl_bpe_model_dir():
    """Tiny random Qwen2-VL with a byte-level BPE tokenizer (prefix breaks under sampling)."""
    return ensure_model("qwen2-vl-bpe")


@pytest.fixture(scope="session")
def tiny_text_model_dir():
    return ensure_model("qwen2-text")


@pytest.fixture(scope="session")
def vllm_server(tiny_vl_model_dir):
    with VLLMServer(tiny_vl_model_dir, model="tiny-vl") as server:
        yield server


@pytest.fixture(scope="session")
def vllm_bpe_server(tiny_vl_bpe_model_dir):
    with VLLMServer(tiny_vl_bpe_model_dir, model="tiny-vl-bpe") as server:
        yield server
