"""Two data-parallel ranks with different distinct images train a step without hanging.

Each rank is a process of its own (gloo on loopback, ``fsdp:d2``) holding ``CuaPPOActor`` and
different rows: rank 0 two MAI-UI episodes (8 rows, 18 images, 8 distinct), rank 1 two
current-screenshot episodes of 3 calls (6 rows, 6 images, 6 distinct). FSDP's collectives run
in every vision-tower call, so a rank that made fewer calls than the other would hang it; the
subprocess timeout turns a hang into a failure. Each rank reports its tower calls (one per
micro-batch: every row holds an image) and the images each encoded.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_RANK = """
import copy, json, sys
import torch
from areal.api.io_struct import FinetuneSpec
from cua_rl.areal.actor import CuaPPOActor
from cua_rl.areal.vision_dedup import vision_tower
from cua_rl.cpu.loopback import torch_on_loopback
from cua_rl.areal.attention import keep_packed_sequences_apart
from cua_rl.testing.actor import actor_config, vision_geometry, window_rows

rank, model_dir = int(sys.argv[1]), sys.argv[2]
torch_on_loopback()
keep_packed_sequences_apart()
config = actor_config(model_dir, backend="fsdp:d2")
config.mb_spec.max_tokens_per_mb = 260
actor = CuaPPOActor(config)
actor.create_process_group()
actor.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=16, train_batch_size=16))
calls = []
vision_tower(actor.model).register_forward_hook(
    lambda m, a, kw, out: calls.append(int(kw["grid_thw"].shape[0])), with_kwargs=True
)
vocab = actor.model.get_output_embeddings().weight.shape[0]
dim, merge = vision_geometry(model_dir)
turns, window = (4, 3) if rank == 0 else (3, 1)
rows = [
    r
    for seed in (1, 2)
    for r in window_rows(turns, window=window, vocab_size=vocab, patch_dim=dim, merge=merge,
                         seed=10 * rank + seed)
]
for row, logp in zip(rows, actor.compute_logp(copy.deepcopy(rows)), strict=True):
    row["prox_logp"] = logp + 0.1
logp_calls = list(calls)
calls.clear()
actor.ppo_update(actor.compute_advantages(copy.deepcopy(rows)))
stats = actor.export_stats()
print(json.dumps({"rank": rank, "logp_calls": logp_calls, "update_calls": calls,
                  "encoded": stats["cua_vision/encoded_images"],
                  "row_images": stats["cua_vision/row_images"]}))
actor.destroy()
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ranks_with_unequal_distinct_images_train_a_step(tmp_path):
    from cua_rl.testing.cache import ensure_model

    model_dir = ensure_model("qwen2-vl-byte")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        out = (tmp_path / f"rank{rank}.out").open("w")
        procs.append(
            (
                subprocess.Popen(
                    [sys.executable, "-c", _RANK, str(rank), str(model_dir)],
                    cwd=ROOT,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                ),
                out,
            )
        )
    reports = []
    try:
        for proc, out in procs:
            proc.wait(timeout=600)  # a hang fails here
            out.close()
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
    for rank, (proc, _) in enumerate(procs):
        text = (tmp_path / f"rank{rank}.out").read_text()
        assert proc.returncode == 0, text[-4000:]
        reports.append(json.loads([ln for ln in text.splitlines() if ln.startswith("{")][-1]))
    r0, r1 = reports
    # Equal micro-batch counts (one tower call each), on unequal images.
    assert len(r0["logp_calls"]) == len(r1["logp_calls"]) >= 2
    assert len(r0["update_calls"]) == len(r1["update_calls"]) >= 2
    assert sum(r0["update_calls"]) < 18 and sum(r1["update_calls"]) == 6
    assert r0["update_calls"] != r1["update_calls"]
    # The statistics are summed over both ranks (18 + 6 images in the rows) and both passes
    # (compute_logp, ppo_update).
    assert r0["row_images"] == r1["row_images"] == 2 * (18 + 6)
    calls = [n for r in reports for key in ("logp_calls", "update_calls") for n in r[key]]
    assert r0["encoded"] == r1["encoded"] == sum(calls)
