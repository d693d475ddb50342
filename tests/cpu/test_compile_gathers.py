"""AReaL's log-prob gathers compiled for dynamic shapes in the CPU harness's workers
(cua_rl/cpu/training.py ``compile_gathers_dynamic``): one compiled graph serves every length,
where torch.compile's defaults compile the first length static and the next again; the values
are the uncompiled function's. In a process of its own: torch's compile state is per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = textwrap.dedent("""
    import json, torch
    from torch._dynamo.utils import counters
    from areal.utils.functional import vocab_parallel as vp
    from cua_rl.cpu.training import GATHERS, compile_gathers_dynamic

    compile_gathers_dynamic()
    worst, graphs = 0.0, {}
    for name in GATHERS:
        fn = getattr(vp, name)
        plain = fn._torchdynamo_orig_callable
        before = counters["stats"]["unique_graphs"]
        for n in (37, 101, 230):
            logits = torch.randn(n, 512, dtype=torch.bfloat16)
            labels = torch.randint(0, 512, (n,))
            got, want = fn(logits, labels, 0.7), plain(logits, labels, 0.7)
            for g, w in zip(*(x if isinstance(x, tuple) else (x,) for x in (got, want))):
                worst = max(worst, (g - w).abs().max().item())
        graphs[name] = counters["stats"]["unique_graphs"] - before
    print(json.dumps({"graphs": graphs, "worst": worst}))
""")


def test_each_gather_compiles_once_for_every_length_with_the_uncompiled_values():
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["graphs"] == {"_gather_logprobs": 1, "_gather_logprobs_entropy": 1}, seen
    assert seen["worst"] < 1e-5, seen
