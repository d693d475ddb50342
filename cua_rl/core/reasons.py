"""Why an episode did not become a training row: one stable code per cause.

A reason is counted in the rollout stats (``rollout/cua/rejected/<reason>``), written to the
monitor (the rollout's ``status_reason``) and to the outcome files that the fail-fast watch reads,
so its string value is an interface: ``Reason`` is a ``StrEnum``, whose members are those strings
wherever they are formatted, compared or serialised. Three families are open-ended, formed from
another part's own name: ``agent_<run reason>`` (the agent's run ended other than completed),
``gateway_<error code>`` (the rollout gateway refused or failed a model call) and
``hook_<hook>`` (a workflow hook raised: ``hook_compute_reward``). docs/rejections.md says what
each means and what to do.
"""

from __future__ import annotations

from enum import StrEnum

AGENT_PREFIX = "agent_"
GATEWAY_PREFIX = "gateway_"
HOOK_PREFIX = "hook_"


class Reason(StrEnum):
    # The episode's services
    GYM_ERROR = "gym_error"
    EVALUATION_FAILED = "evaluation_failed"
    NO_VERDICT = "no_verdict"
    GATEWAY_UNREACHABLE = "gateway_unreachable"
    # The agent's events
    MALFORMED_EVENTS = "malformed_events"
    NO_TURNS = "no_turns"
    MISSING_TOKENS = "missing_tokens"
    PREFIX_BREAK = "prefix_break"
    ROW_TOO_LONG = "row_too_long"
    IMAGE_TOKEN_IN_OUTPUT = "image_token_in_output"
    VIDEO_UNSUPPORTED = "video_unsupported"
    PROCESSOR_UNSUPPORTED = "processor_unsupported"
    # The episode's images
    IMAGE_URL_REFUSED = "image_url_refused"
    IMAGE_FETCH_FAILED = "image_fetch_failed"
    IMAGE_FETCH_TIMEOUT = "image_fetch_timeout"
    IMAGE_TOO_LARGE = "image_too_large"
    IMAGE_DECODE_FAILED = "image_decode_failed"
    IMAGE_NOT_FETCHED = "image_not_fetched"
    TOO_MANY_IMAGES = "too_many_images"
    IMAGE_COUNT_MISMATCH = "image_count_mismatch"
    IMAGE_PAD_MISMATCH = "image_pad_mismatch"
    # A row-building hook returned no row and named no reason
    REJECTED = "rejected"


def agent_reason(run_reason: str) -> str:
    """``agent_<run reason>``: the agent's run ended failed (``agent_timeout``, ...)."""
    return f"{AGENT_PREFIX}{run_reason}"


def gateway_reason(code: str) -> str:
    """``gateway_<code>``: the gateway's last error on the episode (``gateway_sampling_mismatch``)."""
    return f"{GATEWAY_PREFIX}{code}"


def hook_reason(hook: str) -> str:
    """``hook_<hook>``: the workflow's hook raised (``hook_build_rows``); the exception is the
    rejection's detail, its traceback in the rollout log."""
    return f"{HOOK_PREFIX}{hook}"
