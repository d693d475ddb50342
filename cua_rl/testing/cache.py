"""The tiny models by name (``KIND``): builders, and the shared cache that builds each once.

``python -m cua_rl.testing KIND`` builds one; ``ensure_model(KIND)`` returns its folder, building
it under a file lock the first time. The cache key includes a hash of the builders' sources, so a
changed builder never serves a stale model. Apart from ``models`` (Qwen2-VL) and ``families`` (the
production families) so that neither builder module imports the other.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from cua_rl.testing.families import build_tiny_vl_family
from cua_rl.testing.models import WIDE_VOCAB, build_tiny_qwen2, build_tiny_qwen2_vl

BUILDERS = {
    "qwen2-vl-bpe": lambda d, seed: build_tiny_qwen2_vl(d, tokenizer="bpe", seed=seed),
    "qwen2-vl-byte": lambda d, seed: build_tiny_qwen2_vl(d, tokenizer="byte", seed=seed),
    "qwen2-text": lambda d, seed: build_tiny_qwen2(d, seed=seed),
    "qwen2-vl-wide": lambda d, seed: build_tiny_qwen2_vl(
        d, tokenizer="byte", seed=seed, vocab_size=WIDE_VOCAB
    ),
}


def _family_builder(family: str, *, tied: bool = False):
    def build(dst, seed):
        return build_tiny_vl_family(dst, family, seed=seed, tied=tied)

    return build


# The production families, BPE tokenizer and the family's own chat template.
FAMILY_KINDS = ("qwen2.5-vl", "qwen3-vl", "qwen3-vl-moe")
BUILDERS.update({kind: _family_builder(kind) for kind in FAMILY_KINDS})
# The same with tied word embeddings (the tiny models above are untied, as Qwen3-VL-8B is;
# Qwen3-VL-2B ties them): AReaL wraps the FSDP units of the two differently.
TIED = "-tied"
BUILDERS[f"qwen2-vl-bpe{TIED}"] = lambda d, seed: build_tiny_qwen2_vl(
    d, tokenizer="bpe", seed=seed, tied=True
)
BUILDERS.update({f"{kind}{TIED}": _family_builder(kind, tied=True) for kind in FAMILY_KINDS})


def default_cache_dir() -> Path:
    """``$CUA_RL_CACHE`` or the repository's git-ignored ``.cache`` folder."""
    env = os.environ.get("CUA_RL_CACHE")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / ".cache"


def _builder_fingerprint() -> str:
    # Rebuild cached models whenever a builder changes: the cache key includes their hash.
    digest = hashlib.sha256()
    for name in ("models.py", "families.py", "templates.py", "cache.py"):
        digest.update((Path(__file__).parent / name).read_bytes())
    return digest.hexdigest()[:12]


def ensure_model(kind: str, *, seed: int = 0, cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the folder of a built model, building it once under a file lock."""
    if kind not in BUILDERS:
        raise ValueError(f"unknown tiny model {kind!r}; choose one of {sorted(BUILDERS)}")
    root = Path(cache_dir) if cache_dir else default_cache_dir() / "models"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{kind}-s{seed}-{_builder_fingerprint()}"
    if (final / ".complete").exists():
        return final
    with open(root / f".{kind}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / ".complete").exists():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{kind}-", dir=root))
        try:
            BUILDERS[kind](tmp, seed)
            (tmp / ".complete").write_text("ok\n")
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Build a tiny random model folder (no download).")
    parser.add_argument("kind", choices=sorted(BUILDERS))
    parser.add_argument("--out", help="target folder (default: the shared cache, reused)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.out:
        path = BUILDERS[args.kind](Path(args.out), args.seed)
    else:
        path = ensure_model(args.kind, seed=args.seed)
    print(path)
    return 0
