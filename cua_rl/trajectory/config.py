"""Policies of the trajectory conversion, as one validated config dataclass.

Every choice the converter makes when the data is not perfect (a broken prefix, missing token
data, an image it may not fetch) is a field here, so a run's behaviour is visible in its config
and the defaults are the strict ones: reject rather than guess.
"""

from __future__ import annotations

from dataclasses import dataclass

from cua_rl.core.fields import doc
from cua_rl.errors import ConfigError

PREFIX_BREAK_POLICIES = ("rows", "last_segment", "reject")
MISSING_TOKENS_POLICIES = ("reject", "retokenize")


@dataclass
class TrajectoryConfig:
    prefix_break_policy: str = doc(
        "rows",
        (
            "What to do when a turn's prompt ids do not start with the row so far (an agent "
            "that trims its screenshots or re-renders its history): 'rows' trains every run of "
            "consistent turns as a row of its own (every call trained once); 'last_segment' "
            "trains the last run only and drops the others (counted: dropped_turns); 'reject' "
            "drops the episode."
        ),
    )
    missing_tokens_policy: str = doc(
        "reject",
        (
            "What to do when a model output lacks prompt_token_ids, token_ids or "
            "logprobs: 'reject' drops the episode; 'retokenize' rebuilds ids from the request "
            "with the processor and is only allowed when trainer_recomputes_logprobs is true."
        ),
    )
    trainer_recomputes_logprobs: bool = doc(
        False,
        (
            "True when the trainer recomputes old logprobs (actor.recompute_logprob); "
            "required by missing_tokens_policy='retokenize', whose logprobs are placeholders."
        ),
    )
    allowed_image_hosts: tuple[str, ...] = doc(
        (),
        (
            "Hostnames (exact match, no port) that http(s) screenshot URLs may come "
            "from; any other host is refused before a fetch. data: URLs are always allowed."
        ),
    )
    allow_http: bool = doc(False, "Allow plain http:// image URLs (https only when false).")
    max_image_bytes: int = doc(
        20 * 1024 * 1024, "Largest encoded image accepted (data URL payload or HTTP body)."
    )
    image_fetch_timeout_s: float = doc(10.0, "Total time allowed to fetch one image over HTTP.")
    max_images: int = doc(256, "Most images one row may carry; more rejects the episode.")
    max_row_tokens: int = doc(
        0, "Longest row in tokens; 0 means no limit. Longer rows are rejected."
    )

    def __post_init__(self) -> None:
        if self.prefix_break_policy not in PREFIX_BREAK_POLICIES:
            raise ConfigError(
                f"prefix_break_policy={self.prefix_break_policy!r}; use one of "
                f"{', '.join(PREFIX_BREAK_POLICIES)}"
            )
        if self.missing_tokens_policy not in MISSING_TOKENS_POLICIES:
            raise ConfigError(
                f"missing_tokens_policy={self.missing_tokens_policy!r}; use one of "
                f"{', '.join(MISSING_TOKENS_POLICIES)}"
            )
        if self.missing_tokens_policy == "retokenize" and not self.trainer_recomputes_logprobs:
            raise ConfigError(
                "missing_tokens_policy='retokenize' fills logprobs with placeholders, so it "
                "needs trainer_recomputes_logprobs=true (and actor.recompute_logprob in the "
                "trainer); otherwise use missing_tokens_policy='reject'"
            )
        if isinstance(self.allowed_image_hosts, str):
            self.allowed_image_hosts = (self.allowed_image_hosts,)
        self.allowed_image_hosts = tuple(self.allowed_image_hosts)
        for host in self.allowed_image_hosts:
            if not host or ":" in host or "/" in host or "*" in host:
                raise ConfigError(
                    f"allowed_image_hosts entry {host!r} must be a bare hostname "
                    "(no scheme, port, path or wildcard), e.g. 'screenshots.example.com'"
                )
        if self.max_image_bytes <= 0:
            raise ConfigError("max_image_bytes must be positive (bytes), e.g. 20971520")
        if self.image_fetch_timeout_s <= 0:
            raise ConfigError("image_fetch_timeout_s must be positive (seconds), e.g. 10")
        if self.max_images <= 0:
            raise ConfigError("max_images must be positive, e.g. 256")
        if self.max_row_tokens < 0:
            raise ConfigError("max_row_tokens must be >= 0 (0 = no limit)")
