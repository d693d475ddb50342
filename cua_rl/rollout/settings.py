"""What a rollout worker needs to run episodes: the gym, the agent, the model endpoint.

``WorkflowSettings`` is one plain, serialisable dataclass that AReaL ships to each rollout worker
as ``workflow_kwargs``; ``cua_rl.app.config.CUAConfig.workflow_settings()`` builds it from the
YAML's sections, which are declared here so the rollout package does not depend on the launcher.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cua_rl.gateway.config import GatewayConfig, Sampling
from cua_rl.genv import GenvTimeouts
from cua_rl.mini_agent import DriverConfig
from cua_rl.reward import RewardConfig
from cua_rl.rollout.drain import DrainConfig
from cua_rl.tasks import TaskSelectionConfig, TaskSourceConfig
from cua_rl.trajectory.config import TrajectoryConfig


@dataclass
class GymSection:
    base_url: str = field(
        default="", metadata={"help": "Gym server URL without /api/v1, e.g. http://gym:8800"}
    )
    gym_id: str = field(
        default="", metadata={"help": "Gym id on that server (required: no default is safe)"}
    )
    source: TaskSourceConfig = field(
        default_factory=TaskSourceConfig, metadata={"help": "Where tasks come from"}
    )
    selection: TaskSelectionConfig = field(
        default_factory=TaskSelectionConfig,
        metadata={"help": "Train/eval split, name and tag filters, limits"},
    )
    timeouts: GenvTimeouts = field(
        default_factory=GenvTimeouts, metadata={"help": "Gym call timeouts and retry bounds"}
    )


@dataclass
class AgentSection:
    base_url: str = field(
        default="", metadata={"help": "gbox-mini-agent URL, e.g. http://agent:3000 (required)"}
    )
    agent: str = field(default="mai-ui", metadata={"help": "Agent flavour: mai-ui or qwen3-vl"})
    action_space: str = field(
        default="mobile", metadata={"help": "standardActionSpace: mobile (Android) or pc (Linux)"}
    )
    max_steps: int = field(default=15, metadata={"help": "maxSteps of a run (agent-side)"})
    max_run_time_s: float = field(
        default=600.0, metadata={"help": "maxRunTimeSec: the agent stops the run after this"}
    )
    max_step_time_s: float = field(
        default=120.0, metadata={"help": "maxStepTimeSec: limit of one step, model call included"}
    )
    model_options: dict = field(
        default_factory=lambda: {"logprobs": True},
        metadata={
            "help": "Extra keys of the run's model object (the patched agent reads 'logprobs' "
            "in direct mode; the local agent also reads 'parse', 'constrain', 'maxTokens', "
            "'temperature'). Through the gateway the trainer's sampling settings win."
        },
    )
    screenshot_hosts: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Hosts the agent's screenshot URLs come from (e.g. the object store). They "
            "must be in vllm.allowed_media_domains and trajectory.allowed_image_hosts. Empty when "
            "screenshots travel as data URLs."
        },
    )
    driver: DriverConfig = field(
        default_factory=DriverConfig, metadata={"help": "Client-side polling and deadline"}
    )


@dataclass
class EndpointSection:
    mode: str = field(
        default="gateway",
        metadata={
            "help": "gateway: each episode gives its agent a URL of the rollout gateway, which "
            "samples through the trainer's engine (exact tokens, the trainer's sampling, weight "
            "updates waited out). direct: the agent calls vLLM itself and must be patched to "
            "return token ids and logprobs (for agents that cannot be pointed at the gateway)."
        },
    )
    base_url: str = field(
        default="",
        metadata={
            "help": "direct mode only: OpenAI base URL (ending in /v1) the agent calls. Empty: "
            "the engine's own inference servers, spread round-robin. Set it only to roll out "
            "against an external server; its tokens then carry no engine version."
        },
    )
    model_name: str = field(
        default="",
        metadata={"help": "Served model name. Empty: the actor's model path (AReaL's default)"},
    )
    provider: str = field(default="openai", metadata={"help": "Model provider of the run"})


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
