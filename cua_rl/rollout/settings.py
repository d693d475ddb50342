"""What a rollout worker needs to run episodes: the gym, the agent, the model endpoint, the
pauses and the drain.

``WorkflowSettings`` is one plain, serialisable dataclass that AReaL ships to each rollout worker
as ``workflow_kwargs``; ``cua_rl.app.config.CUAConfig.workflow_settings()`` builds it from the
YAML's sections, which are declared here so the rollout package does not depend on the launcher.
The sections the rollout's behaviour modules read (``drain``, ``pause``) are declared here too,
not beside their behaviour: those modules observe the episode (``cua_rl.rollout.episode``) and
may import its types, which a settings module they imported back could not allow.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cua_rl.agent.loop import LoopConfig
from cua_rl.agent.service_driver import DriverConfig
from cua_rl.clients.genv import GenvTimeouts
from cua_rl.core.fields import doc
from cua_rl.errors import ConfigError
from cua_rl.gateway.config import GatewayConfig, Sampling
from cua_rl.reward import RewardConfig
from cua_rl.rollout.groups import GroupSettings
from cua_rl.tasks import TaskSelectionConfig, TaskSourceConfig
from cua_rl.trajectory.config import TrajectoryConfig

# ---- the run's end, the service pauses (read by cua_rl.rollout.drain, service_pauses) ----

# AReaL's task runner waits this long for the cancelled episodes when its engine is destroyed
# (``AsyncTaskRunner.destroy``); a drain must end inside it or the worker stops under it.
AREAL_RUNNER_JOIN_S = 30.0
# Kept for the monitor flush and the runner's own shutdown after the last episode.
MARGIN_S = 5.0
# A drain past its deadline still gives the monitor this long to take the cancelled records.
LAST_FLUSH_S = 1.0


@dataclass
class DrainConfig:
    timeout_s: float = field(
        default=20.0,
        metadata={
            "help": "Seconds the episodes in flight when a run ends get to close: the agent run "
            "abandoned, the gym execution terminated, the monitor told (rollout cancelled, "
            "environment terminated). What is still open then is named in the log. At most "
            f"{AREAL_RUNNER_JOIN_S - MARGIN_S:g}: AReaL waits {AREAL_RUNNER_JOIN_S:g} s for a "
            "worker's episodes before it stops the worker."
        },
    )

    def __post_init__(self) -> None:
        top = AREAL_RUNNER_JOIN_S - MARGIN_S
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0 < t <= top:
            raise ConfigError(
                f"drain.timeout_s={t!r} must be seconds in (0, {top:g}]: AReaL stops a rollout "
                f"worker {AREAL_RUNNER_JOIN_S:g} s after it cancels its episodes, and a drain "
                "cut short there leaves gym executions running (e.g. drain.timeout_s=20)"
            )


@dataclass
class PauseConfig:
    enabled: bool = doc(
        True,
        "Hold new episodes while the gym, the agent service or the model server fails, and "
        "probe it until it answers (docs/rejections.md). false: every episode is started and "
        "rejected as the failure goes on.",
    )
    probe_initial_s: float = doc(1.0, "Wait before the first probe of a failing service (s).")
    probe_max_s: float = doc(
        10.0,
        "Longest wait between two probes (s); the wait doubles from probe_initial_s. Each "
        "failed probe is one entry of failfast's streak: 10 s gives failfast.window=16 its "
        "entries well within failfast.persist_s=180 even with few episodes in flight.",
    )
    probe_timeout_s: float = doc(
        60.0,
        "Bound on one probe of the agent service or the model server (s). The gym's probe is an "
        "execution's create and terminate, bounded by gym.timeouts (a box may take minutes).",
    )

    def __post_init__(self) -> None:
        if not 0 < self.probe_initial_s <= self.probe_max_s:
            raise ConfigError(
                f"pause.probe_initial_s={self.probe_initial_s} and pause.probe_max_s="
                f"{self.probe_max_s}: need 0 < probe_initial_s <= probe_max_s, e.g. 1 and 30"
            )
        if self.probe_timeout_s <= 0:
            raise ConfigError("pause.probe_timeout_s must be positive (seconds), e.g. 120")


# ---- the services ------------------------------------------------------------------------


@dataclass
class GymSection:
    base_url: str = doc("", "Gym server URL without /api/v1, e.g. http://gym:8800")
    gym_id: str = doc("", "Gym id on that server (required: no default is safe)")
    box_type: str = doc(
        "",
        "The kind of box the gym's tasks run on: android, linux or browser (the training "
        "record's box_type). Empty: from agent.action_space (mobile: android, pc: linux).",
    )
    source: TaskSourceConfig = doc(help="Where tasks come from", factory=TaskSourceConfig)
    selection: TaskSelectionConfig = doc(
        help="Train/eval split, name and tag filters, limits", factory=TaskSelectionConfig
    )
    timeouts: GenvTimeouts = doc(help="Gym call timeouts and retry bounds", factory=GenvTimeouts)


CONTEXT_POLICIES = ("", "full", "mai-ui", "current")
AGENT_MODES = ("service", "builtin", "function")


def _logprobs_on() -> dict:
    return {"logprobs": True}


@dataclass
class AgentSection:
    mode: str = doc(
        "service",
        "service: each episode's agent runs on an agent service (gbox-mini-agent, or the local "
        "one) at base_url. builtin: the rollout worker runs the local agent's loop itself "
        "(cua_rl/agent: the same prompts, context policies, parsing and actions), no agent "
        "service. function: the rollout worker calls your own Python agent (agent.function) "
        "with the episode's task, model URL and box; docs/agent.md",
    )
    function: str = doc(
        "",
        "mode=function: your agent, 'package.module:callable' (importable by the trainer and the "
        "rollout workers), called once per episode with the task, the model endpoint (the "
        "episode's gateway URL) and the box; docs/agent.md, 'Train your own agent'",
    )
    base_url: str = doc(
        "", "gbox-mini-agent URL, e.g. http://agent:3000 (required in service mode)"
    )
    agent: str = doc("mai-ui", "Agent flavour: mai-ui or qwen3-vl")
    action_space: str = doc("mobile", "standardActionSpace: mobile (Android) or pc (Linux)")
    max_steps: int = doc(15, "maxSteps of a run (agent-side)")
    max_run_time_s: float = doc(600.0, "maxRunTimeSec: the agent stops the run after this")
    max_step_time_s: float = doc(120.0, "maxStepTimeSec: limit of one step, model call included")
    model_options: dict = doc(
        help="Extra keys of the run's model object (the patched agent reads 'logprobs' in direct "
        "mode; the local agent also reads 'parse', 'constrain', 'maxTokens', 'temperature'). "
        "Through the gateway the trainer's sampling settings win.",
        factory=_logprobs_on,
    )
    screenshot_hosts: list[str] = doc(
        help="Hosts the agent's screenshot URLs come from (e.g. the object store). They must be "
        "in vllm.allowed_media_domains and trajectory.allowed_image_hosts. Empty when "
        "screenshots travel as data URLs.",
        factory=list,
    )
    driver: DriverConfig = doc(help="Client-side polling and deadline", factory=DriverConfig)
    context: str = doc(
        "",
        "The local agent's context policy (docs/agent.md): full (the append-only "
        "conversation), mai-ui (a window of history_n screenshots, history re-rendered from the "
        "parsed action, re-asks), current (the current screenshot and a list of past actions). "
        "Empty: the agent's own (gbox-mini-agent builds its context itself).",
    )
    history_n: int = doc(0, "mai-ui context: screenshots per request; 0: the agent's default (3)")
    builtin: LoopConfig = doc(
        help="mode=builtin: the loop's screenshot transport (image_mode), the wait after each "
        "action (step_latency_s, as the local agent's --step-latency) and its gym timeout",
        factory=LoopConfig,
    )

    def __post_init__(self) -> None:
        if self.mode not in AGENT_MODES:
            raise ConfigError(
                f"agent.mode={self.mode!r}; use service (an agent service at agent.base_url), "
                "builtin (the rollout worker runs the agent loop itself) or function (your own "
                "Python agent, agent.function)"
            )
        if self.context not in CONTEXT_POLICIES:
            raise ConfigError(
                f"agent.context={self.context!r}; use one of full, mai-ui, current (or leave it "
                "empty for the agent's own)"
            )
        if self.history_n < 0:
            raise ConfigError(f"agent.history_n={self.history_n} must be >= 1 (or 0: default)")

    def run_model_options(self) -> dict:
        """What the run's model object carries for the context policy (set fields only)."""
        out: dict = {}
        if self.context:
            out["context"] = self.context
        if self.history_n:
            out["historyN"] = self.history_n
        return out


@dataclass
class EndpointSection:
    mode: str = doc(
        "gateway",
        "gateway: each episode gives its agent a URL of the rollout gateway, which samples "
        "through the trainer's engine (exact tokens, the trainer's sampling, weight updates "
        "waited out). direct: the agent calls vLLM itself and must be patched to return token "
        "ids and logprobs (for agents that cannot be pointed at the gateway).",
    )
    base_url: str = doc(
        "",
        "direct mode only: OpenAI base URL (ending in /v1) the agent calls. Empty: the engine's "
        "own inference servers, spread round-robin. Set it only to roll out against an external "
        "server; its tokens then carry no engine version.",
    )
    model_name: str = doc("", "Served model name. Empty: the actor's model path (AReaL's default)")
    provider: str = doc("openai", "Model provider of the run")


@dataclass
class WorkflowSettings:
    """Everything a rollout worker needs; passed to the workflow as one serialisable kwarg."""

    gym: GymSection
    agent: AgentSection
    endpoint: EndpointSection
    trajectory: TrajectoryConfig
    reward: RewardConfig
    processor_path: str
    monitor_base_url: str = ""
    monitor_token: str = ""
    monitor_spool_path: str = ""
    # Which accepted train episodes go to the trajectory warehouse (cua_rl.warehouse):
    # "successes", "all" or "none".
    store_episodes: str = "successes"
    # The training's monitor client id (its run name); empty: rollouts are not recorded.
    training_ref: str = ""
    # "train", "eval" or "baseline": which monitor record the rollouts belong to.
    phase: str = "train"
    # Steps this run trains (0: unknown). Rollouts the trainer prefetches for a step after the
    # last one are never trained, so they are not recorded against a step that never opens.
    total_steps: int = 0
    sampling: Sampling = field(default_factory=Sampling)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    # Where workers append episode outcomes for the controller's rejection watch (empty: off).
    outcome_dir: str = ""
    drain: DrainConfig = field(default_factory=DrainConfig)
    # The group filter's settings (train phase): episodes per group, zero-variance tolerance,
    # the per-group normalisation of episode rewards.
    group: GroupSettings = field(default_factory=GroupSettings)
    # Whether and how new episodes wait while a service fails (cua_rl.rollout.service_pauses).
    pause: PauseConfig = field(default_factory=PauseConfig)
