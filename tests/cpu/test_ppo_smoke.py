"""AReaL's real PPOTrainer runs two PPO steps on CPU (FSDP2 on gloo + vLLM CPU)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cua_rl.cpu.smoke import lowercase_share
from tests.conftest import note_cost

REPO = Path(__file__).resolve().parents[2]


def test_lowercase_share():
    assert lowercase_share("") == 0.0
    assert lowercase_share("abCD") == 0.5
    assert lowercase_share("é1") == 0.0


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = (
                Path(f"/proc/{pid}/cmdline")
                .read_bytes()
                .replace(b"\0", b" ")
                .decode(errors="replace")
            )
        except OSError:
            continue
        if text in cmd:
            found.append(f"{pid}: {cmd[:200]}")
    return found


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_two_ppo_steps_on_cpu(tmp_path):
    run_dir = tmp_path / "smoke"
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "cua_rl.cpu.smoke", "--run-dir", str(run_dir), "--steps", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1700,
    )
    note_cost("AReaL's PPO smoke", time.monotonic() - t0)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert [s["global_step"] for s in steps] == [0, 1]
    for s in steps:
        # A real update happened: gradients flowed over generated tokens...
        assert s["ppo_actor/n_valid_tokens"] > 0
        assert (
            math.isfinite(s["ppo_actor/update/grad_norm"]) and s["ppo_actor/update/grad_norm"] > 0
        )
        # ...rewards are the workflow's lowercase share...
        assert 0.0 <= s["ppo_actor/task_reward/min"] <= s["ppo_actor/task_reward/max"] <= 1.0
        # ...and weights went to vLLM after the step.
        assert s["timeperf/update_weights"] > 0
    # Step 0 was sampled with the weights the trainer holds: vLLM's logprobs and the trainer's
    # recomputation (packed micro-batch, fp32) must agree token by token.
    first = steps[0]
    assert first["ppo_actor/update/version_stats/sample_staleness_theta_max"] == 0
    gap = max(
        abs(first["ppo_actor/update/compute_logp/kl_div_direct/min"]),
        abs(first["ppo_actor/update/compute_logp/kl_div_direct/max"]),
    )
    assert gap < 1e-2, gap
    assert "[smoke] step 1:" in out
    # AReaL stopped what it started: no worker or vLLM server still names the run folder.
    assert _processes_mentioning(str(run_dir)) == []
