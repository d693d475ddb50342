"""Rejection reasons: the strings stats, the monitor and the outcome files carry stay the same,
and docs/rejections.md documents every one."""

from __future__ import annotations

import json
import re
from pathlib import Path

from cua_rl.app.failfast import ADVICE, advice_for
from cua_rl.core.reasons import AGENT_PREFIX, GATEWAY_PREFIX, Reason, agent_reason, gateway_reason

ROOT = Path(__file__).resolve().parents[2]

# The codes as they stood in stats and databases before the enumeration, written out by hand.
KNOWN = """gym_error evaluation_failed no_verdict gateway_unreachable malformed_events no_turns
missing_tokens prefix_break row_too_long image_token_in_output video_unsupported
processor_unsupported image_url_refused image_fetch_failed image_fetch_timeout image_too_large
image_decode_failed image_not_fetched too_many_images image_count_mismatch image_pad_mismatch
rejected""".split()


def test_the_values_are_the_strings_counted_before():
    assert sorted(r.value for r in Reason) == sorted(KNOWN)
    r = Reason.GYM_ERROR
    assert f"rollout/cua/rejected/{r}" == "rollout/cua/rejected/gym_error"
    assert json.dumps({"reason": r}) == '{"reason": "gym_error"}'
    assert agent_reason("timeout") == "agent_timeout"
    assert gateway_reason("sampling_mismatch") == "gateway_sampling_mismatch"


def test_the_docs_table_lists_every_reason_and_family():
    text = (ROOT / "docs/rejections.md").read_text()
    documented = set(re.findall(r"^\| `([a-z_<>]+)` \|", text, flags=re.M))
    for r in Reason:
        assert r.value in documented, r.value
    assert f"{AGENT_PREFIX}<reason>" in documented and f"{GATEWAY_PREFIX}<code>" in documented


def test_every_advice_is_for_a_reason_that_exists():
    for key in ADVICE:
        assert key in set(Reason) or key.startswith(GATEWAY_PREFIX), key
    assert "allowed_image_hosts" in advice_for(Reason.IMAGE_URL_REFUSED)
    assert "allowed_image_hosts" in advice_for("gateway_image_url_refused")
    assert "'timeout'" in advice_for(agent_reason("timeout"))
