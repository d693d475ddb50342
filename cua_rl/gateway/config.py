"""Settings of the rollout gateway: where it listens, what the agent is told, what it accepts.

The gateway runs inside AReaL's rollout worker. In production the agent runs on another machine,
so the address the gateway binds and the URL it advertises are separate settings; an empty
advertised host means the worker's own address as AReaL sees it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cua_rl.core.fields import doc
from cua_rl.errors import ConfigError
from cua_rl.gateway.weight_pauses import PauseBound

GATEWAY_BACKENDS = ("auto", "vllm", "sglang", "text")
MISMATCH_POLICIES = ("override", "error")


@dataclass
class GatewayConfig:
    bind_host: str = doc(
        "127.0.0.1",
        (
            "Address the gateway listens on in each rollout worker. 127.0.0.1 when the "
            "agent runs on the same machine; 0.0.0.0 when it runs elsewhere."
        ),
    )
    bind_port: int = doc(0, "Port to listen on; 0 picks a free port per worker process.")
    public_host: str = doc(
        "",
        (
            "Host (name or IP) the agent uses to reach the gateway. Empty: the bind "
            "host, or the worker's own IP address when bind_host is 0.0.0.0."
        ),
    )
    public_port: int = doc(0, "Port the agent uses (behind a port mapping); 0: the bound port.")
    backend: str = doc(
        "auto",
        (
            "Request shape of the inference servers: 'vllm' (tokens in on "
            "/inference/v1/generate), 'sglang' (tokens in on /generate), 'text' (chat "
            "completions: the server re-tokenises the history, prefix breaks are counted). "
            "'auto': the rollout backend's (rollout.backend), vllm when unknown. A vLLM "
            "without the tokens-in endpoint falls back to text by itself, with a warning."
        ),
    )
    sampling_mismatch: str = doc(
        "override",
        (
            "What to do when the agent asks for sampling settings (temperature, top_p, "
            "top_k, max_tokens, logit_bias, ...) other than the trainer's: 'override' samples "
            "with the trainer's and records what the agent asked; 'error' answers 400."
        ),
    )
    max_body_bytes: int = doc(
        128 * 1024 * 1024,
        (
            "Largest request body accepted (the agent resends the whole history, "
            "screenshots included, each turn); larger bodies get 413."
        ),
    )
    max_images: int = doc(
        64, "Most images one request may carry (keep <= vllm.limit_mm_per_prompt)."
    )
    request_timeout_s: float = doc(
        600.0, "Longest one generation request to the model server may take."
    )
    max_aborts: int = doc(
        16,
        (
            "Most times in a row the model server may abort one call without sampling a "
            "token while the rollout is not paused (a server that aborts everything would "
            "otherwise be asked forever); then the agent gets 502."
        ),
    )
    max_pause_wait_s: float = doc(
        3600.0,
        (
            "Longest a paused rollout (weight update, then the save and evaluation the trainer "
            "runs before resuming) may hold the calls waiting for it until a pause of this run "
            "has ended, and the ceiling of the bound derived after (pause_wait_factor); past "
            "it every waiting call gets 503 'pause_timeout' with the reason. AReaL tells the "
            "rollout nothing of a weight update that hangs: this is what ends such a wait. "
            "Keep it above the first step's update + save + evaluation."
        ),
    )
    pause_wait_factor: float = doc(
        4.0,
        (
            "Once a pause of this run has ended, a pause may last this multiple of the longest "
            "one measured (from the first call that found the rollout paused to the resume), "
            "within [min_pause_wait_s, max_pause_wait_s]; then its waiting calls get 503 "
            "'pause_timeout'. Raise it when some steps' pauses are much longer than others "
            "(an evaluation every N steps)."
        ),
    )
    min_pause_wait_s: float = doc(
        300.0,
        (
            "Floor of the bound derived from the measured pauses (pause_wait_factor): a run "
            "whose first pauses were short still gets this long. max_pause_wait_s wins over it "
            "(a floor above it leaves the bound at max_pause_wait_s)."
        ),
    )
    max_connections: int = doc(
        0,
        (
            "Connections in each of the gateway's two pools (generations, image "
            "fetches). 0: rollout.max_concurrent_rollouts when the training config sets it "
            "(one call in flight per episode), else unbounded."
        ),
    )
    stream_keepalive_s: float = doc(
        15.0,
        (
            "A streamed call opens its event stream at once and sends an SSE comment "
            "this often while it waits (for a pause, the model), so idle-connection timeouts "
            "of clients and proxies do not cut it."
        ),
    )
    model_outage_s: float = doc(
        600.0,
        (
            "Longest the model server may stay out (connections refused or dropped, 5xx "
            "answers) while a call is held and re-sent with a growing backoff (at most 10 s "
            "apart); then the agent gets 502 'model_server_error' with how long it waited. The "
            "default outlasts a restart of an 8B model's vLLM; keep agent.max_step_time_s "
            "above it, or the agent's step ends the call first."
        ),
    )
    model_server_url: str = doc(
        "",
        (
            "Send every model call to this URL instead of the server the engine picks "
            "(empty: the engine's). For a proxy in front of a single model server, e.g. "
            "bench/soak.py's fault proxy; pauses, aborts and versions stay the engine's."
        ),
    )

    def resolved_backend(self) -> str:
        return "vllm" if self.backend == "auto" else self.backend

    def __post_init__(self) -> None:
        if self.backend not in GATEWAY_BACKENDS:
            raise ConfigError(
                f"gateway.backend={self.backend!r}; use one of {', '.join(GATEWAY_BACKENDS)}"
            )
        if self.sampling_mismatch not in MISMATCH_POLICIES:
            raise ConfigError(
                f"gateway.sampling_mismatch={self.sampling_mismatch!r}; use one of "
                f"{', '.join(MISMATCH_POLICIES)}"
            )
        for name in ("bind_port", "public_port"):
            value = getattr(self, name)
            if not 0 <= value < 65536:
                raise ConfigError(f"gateway.{name}={value} is not a port (0-65535)")
        if any(c in self.public_host for c in "/: "):
            raise ConfigError(
                f"gateway.public_host={self.public_host!r} must be a bare host name or IP "
                "(no scheme, port or path); set gateway.public_port for the port"
            )
        if self.model_server_url and not self.model_server_url.startswith(("http://", "https://")):
            raise ConfigError(
                f"gateway.model_server_url={self.model_server_url!r} must be an http(s) URL "
                "(or empty for the engine's servers)"
            )
        if self.max_connections < 0:
            raise ConfigError("gateway.max_connections must be >= 0 (0: sized from the rollout)")
        if self.max_body_bytes <= 0 or self.max_images <= 0:
            raise ConfigError("gateway.max_body_bytes and gateway.max_images must be positive")
        if self.request_timeout_s <= 0:
            raise ConfigError("gateway.request_timeout_s must be positive (seconds)")
        if not self.model_outage_s > 0:
            raise ConfigError(
                f"gateway.model_outage_s={self.model_outage_s} must be positive: the seconds a "
                "call is held while the model server is out, e.g. gateway.model_outage_s=600"
            )
        if self.max_aborts < 1 or self.max_pause_wait_s <= 0 or self.stream_keepalive_s <= 0:
            raise ConfigError(
                "gateway.max_aborts must be >= 1; gateway.max_pause_wait_s and "
                "gateway.stream_keepalive_s positive"
            )
        if not (self.pause_wait_factor >= 1 and self.min_pause_wait_s > 0):
            raise ConfigError(
                f"gateway.pause_wait_factor={self.pause_wait_factor:g} must be >= 1 and "
                f"gateway.min_pause_wait_s={self.min_pause_wait_s:g} positive: a pause is "
                "bounded at the factor times the longest one measured, at least the floor (e.g. "
                "gateway.pause_wait_factor=4 gateway.min_pause_wait_s=300)"
            )

    @property
    def pause_bound(self) -> PauseBound:
        return PauseBound(self.max_pause_wait_s, self.pause_wait_factor, self.min_pause_wait_s)


# AReaL's default top_k (1e8): larger than any vocabulary, so no truncation.
AREAL_NEUTRAL_TOP_K = 10**8


def top_k_neutral(top_k: int | None) -> bool:
    """Whether top_k leaves the distribution whole: unset, <= 0, or AReaL's default."""
    return top_k is None or top_k <= 0 or top_k >= AREAL_NEUTRAL_TOP_K


@dataclass
class Sampling:
    """The trainer's sampling settings for one phase (gconfig or eval_gconfig)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    min_new_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    greedy: bool = False
    max_tokens: int = 0  # prompt + reply, as gconfig.max_tokens; 0: no cap
    # Per call, what the agent asked that leaves the distribution alone: the top-k candidates
    # to report per token (OpenAI's ``top_logprobs``) and its ``stop`` strings.
    top_logprobs: int = 0
    stop: list[str] = field(default_factory=list)

    def room(self, prompt_len: int) -> int:
        """New tokens one call may sample: AReaL's rule, max_new_tokens within max_tokens."""
        if self.max_tokens <= 0:
            return self.max_new_tokens
        return min(self.max_new_tokens, self.max_tokens - prompt_len)

    @classmethod
    def from_gconfig(cls, g) -> Sampling:
        return cls(
            temperature=float(g.temperature),
            top_p=float(g.top_p),
            top_k=int(g.top_k) if g.top_k is not None else -1,
            max_new_tokens=int(g.max_new_tokens),
            min_new_tokens=int(g.min_new_tokens or 0),
            stop_token_ids=list(g.stop_token_ids or []),
            greedy=bool(g.greedy),
            max_tokens=int(getattr(g, "max_tokens", 0) or 0),
        )

    def distribution(self) -> dict[str, float | int]:
        """The settings that shape the sampled distribution, in the servers' spelling: greedy is
        temperature 0, and a neutral top_k (``top_k_neutral``) is -1, "no truncation". Every request
        shape and every comparison with what the agent asked goes through this one rule."""
        return {
            "temperature": 0.0 if self.greedy else float(self.temperature),
            "top_p": float(self.top_p),
            "top_k": -1 if top_k_neutral(self.top_k) else int(self.top_k),
        }

    def vllm_params(self, max_tokens: int) -> dict:
        """vLLM ``SamplingParams`` JSON; ``logprobs: 0`` returns the sampled token's logprob."""
        params = {
            **self.distribution(),
            "max_tokens": max_tokens,
            "min_tokens": min(self.min_new_tokens, max_tokens),
            # vLLM lists the sampled token first, then the candidates by rank, cut at this count:
            # one more than asked keeps the top k whatever was sampled (vLLM's cap is 20).
            "logprobs": min(self.top_logprobs + 1, 20) if self.top_logprobs else 0,
        }
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        if self.stop:
            params["stop"] = list(self.stop)
        return params


def check_trainer_sampling(gconfig, *, use_lora: bool) -> None:
    """What gateway mode cannot sample faithfully for the trainer, refused with the fix."""
    if use_lora:
        raise ConfigError(
            "endpoint.mode=gateway samples the served base model: it does not select the "
            "versioned LoRA adapter, so the rows would not be the policy's. Set "
            "actor.use_lora=false, or endpoint.mode=direct"
        )
    if float(gconfig.top_p) < 1.0 or not top_k_neutral(gconfig.top_k):
        raise ConfigError(
            f"gconfig.top_p={gconfig.top_p} / top_k={gconfig.top_k} truncate the distribution "
            "the server samples from (and its logprobs), but the actor's recompute applies the "
            "temperature only, so the PPO ratios would compare two distributions: set "
            "gconfig.top_p=1.0 and gconfig.top_k=-1"
        )


def pause_warning(saver, evaluator, step_time_s: float | None, pause_wait_s: float) -> str | None:
    """AReaL keeps the rollout paused from a weight update until that step's save and
    evaluation end; a model call arriving then waits for all of it. Returns a warning when the
    agent's step time may not cover that (the step then fails as if the gateway were down)."""
    timers = [t for t in (saver, evaluator) if t is not None]
    if not any(getattr(t, f, None) for t in timers for f in ("freq_epochs", "freq_steps")):
        return None
    if step_time_s is None or step_time_s >= pause_wait_s:
        return None
    return (
        f"saver/evaluator run while the rollout is paused, and a model call arriving then waits "
        f"for the weight update, the save and the evaluation, up to gateway.max_pause_wait_s="
        f"{pause_wait_s:g}; agent.max_step_time_s={step_time_s:g} fails the agent's step first. "
        f"Set gateway.max_pause_wait_s to your longest update + save + evaluation and "
        f"agent.max_step_time_s to at least that (e.g. both {pause_wait_s:g}, or both "
        f"{step_time_s:g} if that covers them), or set saver.freq_epochs/freq_steps and "
        f"evaluator.freq_epochs/freq_steps to null"
    )


def outage_warning(step_time_s: float | None, outage_s: float) -> str | None:
    """A model call is held through a model-server outage for up to ``gateway.model_outage_s``:
    a warning when the agent's step limit ends it first (the step fails as a model error
    instead of waiting out a restart)."""
    if step_time_s is None or step_time_s > outage_s:
        return None
    return (
        f"a model call is held through a model-server outage for up to gateway.model_outage_s="
        f"{outage_s:g}, but agent.max_step_time_s={step_time_s:g} ends the agent's step first: "
        f"set agent.max_step_time_s above it (e.g. {outage_s + 60:g}) or gateway.model_outage_s "
        f"below it (e.g. {max(step_time_s - 20, step_time_s / 2):g})"
    )
