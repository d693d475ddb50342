"""Configuration of the CUA agent example: AReaL's GRPO config plus one section per concern.

``CUAConfig`` is what ``load_expr_config(argv, CUAConfig)`` builds from a YAML file and
``key=value`` overrides. The sections reuse the library's own config dataclasses (task selection,
trajectory policies, reward shaping, run driver, gym timeouts) so each knob is documented once.
``CUAConfig.workflow_settings()`` extracts the part the rollout workers need: a plain dataclass
that AReaL can ship to workers as ``workflow_kwargs``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import NamedTuple
from urllib.parse import urlsplit

from areal.api.cli_args import GRPOConfig, vLLMConfig

from cua_rl.agent.builtin import check_model_options
from cua_rl.agent.function import load_agent_function
from cua_rl.app.config_checks import FieldError, check_fields
from cua_rl.app.failfast import FailFastConfig
from cua_rl.app.placement import check_placement
from cua_rl.areal.logits import LogitsConfig
from cua_rl.areal.support import check_areal_version
from cua_rl.areal.vision import CuaActorConfig, vision_packing_warning
from cua_rl.audit.config import AuditConfig
from cua_rl.core.fields import doc
from cua_rl.credit.config import StepCreditConfig
from cua_rl.credit.keys import require_imagehash
from cua_rl.curriculum.selector import CurriculumConfig
from cua_rl.errors import ConfigError, ConfigProblems
from cua_rl.gateway.config import (
    GatewayConfig,
    Sampling,
    check_trainer_sampling,
    outage_warning,
    pause_warning,
)
from cua_rl.inference.config import InferenceSection
from cua_rl.logs import get_logger
from cua_rl.reward import RewardConfig
from cua_rl.rollout.groups import (
    COMPLETE_GROUPS,
    COMPLETE_VARIED_GROUPS,
    GroupNormConfig,
    GroupSettings,
)
from cua_rl.rollout.settings import (
    AgentSection,
    DrainConfig,
    EndpointSection,
    GymSection,
    PauseConfig,
    WorkflowSettings,
)
from cua_rl.trajectory.config import TrajectoryConfig
from cua_rl.warehouse.episode import STORE_POLICIES
from cua_rl.warehouse.replay import ReplayConfig

LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs", "processed_logits", "raw_logits")
ENDPOINT_MODES = ("gateway", "direct")
DEFAULT_WORKFLOW = "examples.cua_agent.workflow.CUAAgentWorkflow"

log = get_logger(__name__)


@dataclass
class CUAvLLMConfig(vLLMConfig):
    """vLLM server options AReaL's ``vLLMConfig`` lacks. AReaL turns every non-empty field into
    ``--kebab-name value`` (a list into one flag followed by its items), so these reach vLLM."""

    limit_mm_per_prompt: str = doc(
        "",
        'JSON object, e.g. \'{"image": 64, "video": 0}\': most images per prompt. A multi-turn '
        "GUI episode keeps every screenshot in its prompt, so this bounds the episode length in "
        "steps.",
    )
    allowed_media_domains: list[str] = doc(
        help="Hostnames vLLM may fetch image URLs from (exact match, no port). Empty means any "
        "URL, loopback included: set it in production.",
        factory=list,
    )
    enable_scale_out: bool = doc(
        True,
        "Serve vLLM's tokens-in endpoint (POST /inference/v1/generate), which the rollout "
        "gateway samples through (endpoint.mode=gateway).",
    )
    kv_cache_memory_bytes: int | None = doc(
        None,
        "Bytes of KV cache the server allocates (vLLM's --kv-cache-memory-bytes). Empty: vLLM "
        "sizes it (GPU: gpu_memory_utilization; CPU: 4 GiB). The CPU harness sets 128 MiB when "
        "empty (more if one request of max_model_len needs more). It must hold one request of "
        "max_model_len tokens, or the server does not start: checked against the policy's "
        "config.json at load. vLLM's VLLM_CPU_KVCACHE_SPACE (GiB), where set, wins over it.",
    )
    logprobs_mode: str = doc(
        "processed_logprobs",
        "Which logprobs vLLM returns. processed_logprobs: of the distribution sampled from "
        "(after temperature), what decoupled PPO needs at any temperature; raw_logprobs "
        "(vLLM's default) equal it only at temperature 1.",
    )

    def __post_init__(self):
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(
                f"vllm.logprobs_mode={self.logprobs_mode!r}; use one of {', '.join(LOGPROBS_MODES)}"
            )
        if self.limit_mm_per_prompt:
            try:
                parsed = json.loads(self.limit_mm_per_prompt)
            except json.JSONDecodeError as e:
                raise ConfigError(
                    f"vllm.limit_mm_per_prompt={self.limit_mm_per_prompt!r} is not JSON ({e}); "
                    "write it as a JSON string, e.g. '{\"image\": 64}'"
                ) from None
            if not isinstance(parsed, dict):
                raise ConfigError(
                    'vllm.limit_mm_per_prompt must be a JSON object like {"image": 64}'
                )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ConfigError(
                f"vllm.kv_cache_memory_bytes={self.kv_cache_memory_bytes}: give a positive "
                "number of bytes, or leave it empty for vLLM's own sizing"
            )
        for domain in self.allowed_media_domains:
            if not domain or any(c in domain for c in ":/*"):
                raise ConfigError(
                    f"vllm.allowed_media_domains entry {domain!r} must be a bare hostname "
                    "(vLLM matches hostnames exactly: no scheme, port or wildcard)"
                )


class MonitorTarget(NamedTuple):
    url: str  # empty: none configured (the embedded monitor on db_path, or none)
    token: str  # empty: no project token


@dataclass
class MonitorSection:
    enabled: bool = doc(True, "Record the run in a Training Monitor")
    base_url: str = doc(
        "",
        "Monitor URL (default $MONITOR_BASE_URL). Empty with db_path set: train.py serves an "
        "embedded monitor on a free loopback port.",
    )
    token: str = doc("", "Project token (default $MONITOR_PROJECT_TOKEN)")
    db_path: str = doc("", "SQLite file of the embedded monitor (used when base_url is empty)")
    run_name: str = doc("", "Training run name (unique). Empty: {experiment_name}-{trial_name}")
    spool_path: str = doc(
        "", "Spool file for records the monitor could not take (default: temp dir)"
    )
    heartbeat_s: float = doc(
        30.0,
        "Seconds between the training's heartbeats; keep the monitor's --heartbeat-timeout-s "
        "several beats longer (default 600), or a live trainer is reaped",
    )
    store_episodes: str = doc(
        "successes",
        "Which accepted training episodes the trajectory warehouse keeps, to rebuild their rows "
        "exactly (replay, export; docs/warehouse.md): successes (what replay draws from, and "
        "rare where replay matters), all (failures too, for exports), none",
    )

    def resolved(self) -> MonitorTarget:
        """The monitor's URL and project token: the config's, else ``$MONITOR_BASE_URL`` and
        ``$MONITOR_PROJECT_TOKEN``. The one place they are resolved: the launcher hands the
        result to the embedded monitor, its clients and the rollout workers, which never read
        the environment for them (the token stays out of the recorded config)."""
        return MonitorTarget(
            self.base_url or os.environ.get("MONITOR_BASE_URL", ""),
            self.token or os.environ.get("MONITOR_PROJECT_TOKEN", ""),
        )

    def __post_init__(self):
        if self.store_episodes not in STORE_POLICIES:
            raise ConfigError(
                f"monitor.store_episodes={self.store_episodes!r} must be one of "
                f"{list(STORE_POLICIES)} (e.g. monitor.store_episodes=successes)"
            )
        if not 0 < self.heartbeat_s <= 300:
            raise ConfigError(
                f"monitor.heartbeat_s={self.heartbeat_s} must be seconds in (0, 300] "
                "(e.g. 30; the monitor reaps a training silent for --heartbeat-timeout-s)"
            )


@dataclass
class CUAConfig(GRPOConfig):
    actor: CuaActorConfig = doc(
        help="AReaL's PPO actor settings, and the vision tower's (actor.vision)",
        factory=CuaActorConfig,
    )
    gym: GymSection = doc(help="The gym server", factory=GymSection)
    agent: AgentSection = doc(
        help="The agent: a gbox-mini-agent service, the built-in loop, or your own Python "
        "function (agent.mode)",
        factory=AgentSection,
    )
    endpoint: EndpointSection = doc(help="Model endpoint the agent calls", factory=EndpointSection)
    trajectory: TrajectoryConfig = doc(
        help="Event log -> training row policies", factory=TrajectoryConfig
    )
    reward: RewardConfig = doc(help="Evaluation -> reward, and shaping", factory=RewardConfig)
    monitor: MonitorSection = doc(help="Training Monitor", factory=MonitorSection)
    vllm: CUAvLLMConfig = doc(
        help="The vLLM server AReaL launches (AReaL's options and ours)", factory=CUAvLLMConfig
    )
    curriculum: CurriculumConfig = doc(
        help="Which tasks each batch draws, and zero-variance groups", factory=CurriculumConfig
    )
    gateway: GatewayConfig = doc(
        help="The rollout gateway (endpoint.mode=gateway)", factory=GatewayConfig
    )
    failfast: FailFastConfig = doc(
        help="Stop a training whose episodes are all rejected for one reason",
        factory=FailFastConfig,
    )
    drain: DrainConfig = doc(
        help="How the episodes in flight are closed when the run ends", factory=DrainConfig
    )
    pause: PauseConfig = doc(
        help="New episodes wait while the gym, the agent or the model server fails",
        factory=PauseConfig,
    )
    workflow: str = doc(
        DEFAULT_WORKFLOW,
        "Rollout workflow class as a dotted path (pkg.module.Class): a subclass of "
        "CUAAgentWorkflow with your hooks, in an importable module (not __main__).",
    )
    logits: LogitsConfig = doc(
        help="Where the trainer computes full-vocabulary logits", factory=LogitsConfig
    )
    replay: ReplayConfig = doc(
        help="Recorded successes of a task put into its groups that failed entirely "
        "(cua_rl/warehouse/replay.py, docs/learning.md); off by default",
        factory=ReplayConfig,
    )
    step_credit: StepCreditConfig = doc(
        help="Step credit from screen states: steps of a task's group that start from one "
        "state share a step group, and each step's return minus its group's mean is added to "
        "its tokens' advantage (cua_rl/credit, docs/credit.md); off by default",
        factory=StepCreditConfig,
    )
    group_norm: GroupNormConfig = doc(
        help="GRPO's per-group normalisation of episode rewards, done by the group filter "
        "(each episode counted once, however many rows it has); actor.reward_norm stays null",
        factory=GroupNormConfig,
    )
    inference: InferenceSection = doc(
        help="Where the rollout workers start the inference server from (docs/gpu.md)",
        factory=InferenceSection,
    )
    audit: AuditConfig = doc(
        help="The verifier audit (python -m cua_rl.audit, docs/audit.md): scripted agents run "
        "on every task of the gym section's task source, before they train a policy",
        factory=AuditConfig,
    )
    cpu: bool = doc(
        False,
        "Train on this machine's CPU with the harness in cua_rl/cpu (make demo, make learn, "
        "configs/local.yaml). False: AReaL's GPU path; the GPUs the backend strings imply are "
        "checked against the scheduler at load (cua_rl/app/placement.py).",
    )

    warm_start_workers: bool = doc(
        True,
        "With cpu: true and scheduler.type: local, start AReaL's workers as forks of one process "
        "per run that has imported what they import (cua_rl/cpu/warm_start.py): about 12 CPU s "
        "less per worker; the one $CUA_RL_ZYGOTE names, if set (several trainings sharing one). "
        "False: each worker imports them itself. GPU, Ray and Slurm runs start their workers "
        "cold either way.",
    )
    worker_startup_s: float = doc(
        300.0,
        "How long AReaL's scheduler waits for each worker it starts (actor, rollout, "
        "eval-rollout) to answer. AReaL builds its local and Ray schedulers with 30 s, which a "
        "busy node importing torch can exceed; Slurm's own default is 300 s.",
    )

    def __post_init__(self):
        super().__post_init__()
        self.validate()

    def validate(self) -> None:
        """Every check; all that fail are raised together (``ConfigProblems``), each message
        saying how to fix it. The table's rows (ranges and required keys, config_checks.py)
        come first; the checks across sections run once those pass, as they read the same
        values and would only repeat them."""
        check_fields(self)
        problems = []
        for check in (
            self._validate_sampling,
            self._validate_workflow,
            self._validate_endpoint,
            self._validate_agent_function,
            self._validate_model_endpoint,
            self._validate_normalisation,
            self._validate_step_credit,
            self.validate_curriculum,
            self._validate_inference,
            self._validate_placement,
        ):
            try:
                check()
            except ConfigError as exc:
                problems.extend(exc.problems if isinstance(exc, ConfigProblems) else [exc])
            except (ValueError, TypeError, AssertionError):
                # A later check tripping over a value an earlier one refused (AReaL's parse of
                # rollout.backend=trtllm:d4) would only repeat it, less clearly.
                if not problems:
                    raise
        ConfigProblems.raise_for(problems)
        warning = vision_packing_warning(self.actor)
        if warning:
            log.warning(warning)

    def _validate_sampling(self) -> None:
        """AReaL's version for selective logits, replay against the group, a group's variance."""
        if self.logits.selective:
            check_areal_version()
        self.replay.check_group_size(self.gconfig.n_samples)
        if self.replay.enabled and self.replay.trainings and not self.monitor.enabled:
            raise ConfigError(
                f"replay.trainings={self.replay.trainings} are read from the Training Monitor's "
                "episode store: set monitor.enabled=true, or leave replay.trainings empty (this "
                "training's own successes)"
            )
        if self.gconfig.n_samples > 1 and self.gconfig.temperature == 0:
            raise ConfigError(
                f"gconfig.temperature=0 with gconfig.n_samples={self.gconfig.n_samples}: every "
                "member of a group would act the same, so group advantages are all zero; set "
                "gconfig.temperature (e.g. 1.0) or gconfig.n_samples=1"
            )
        self.failfast.check_concurrency(self.rollout.max_concurrent_rollouts)

    def _validate_workflow(self) -> None:
        parts = self.workflow.split(".")
        if len(parts) < 2 or not all(p.isidentifier() for p in parts) or parts[0] == "__main__":
            raise ConfigError(
                f"workflow={self.workflow!r} must be an importable dotted path to a class, e.g. "
                "mypkg.workflows.MyWorkflow (AReaL's workers import it; __main__ is not importable)"
            )

    def _validate_endpoint(self) -> None:
        if self.endpoint.mode not in ENDPOINT_MODES:
            raise ConfigError(
                f"endpoint.mode={self.endpoint.mode!r}; use gateway (the default) or direct"
            )
        if self.endpoint.mode == "gateway":
            self._validate_gateway()
        if self.agent.mode == "builtin":
            check_model_options(self.agent.model_options, self.agent.action_space)

    def _validate_agent_function(self) -> None:
        """agent.mode=function: the callable imports here (the workers import it the same way),
        and its model calls go through the gateway, which records their tokens."""
        if self.agent.mode != "function":
            return
        if not self.agent.function.strip():
            raise FieldError(
                "agent.function",
                "agent.function='' must be set with agent.mode=function: your agent as "
                "'package.module:callable', e.g. "
                "agent.function=examples.cua_agent.openai_agent:run",
            )
        if self.endpoint.mode != "gateway":
            raise FieldError(
                "endpoint.mode",
                f"endpoint.mode={self.endpoint.mode!r} with agent.mode=function: a function's "
                "model calls are trained from what the rollout gateway captures; set "
                "endpoint.mode=gateway",
            )
        try:
            load_agent_function(self.agent.function)
        except ConfigError as exc:
            raise FieldError("agent.function", str(exc)) from exc

    def _validate_inference(self) -> None:
        self.inference.check(self)

    def _validate_placement(self) -> None:
        if not self.cpu:
            check_placement(self)

    def _validate_model_endpoint(self) -> None:
        """Direct mode's constraints, the screenshot hosts' reach, the external endpoint's URL."""
        if (
            self.endpoint.mode == "direct"
            and self.agent.model_options.get("constrain") == "regex"
            and (self.actor.use_decoupled_loss or not self.actor.recompute_logprob)
        ):
            # vLLM applies a structured-output grammar mask to the logits before it computes
            # logprobs, so the recorded logprobs are those of the masked distribution (near 0 where
            # the grammar leaves one choice) while the trainer scores the unmasked model: measured
            # 4.7 nats apart per token at identical weights. Only the trainer's own recomputation
            # can then serve as the old policy.
            raise ConfigError(
                "agent.model_options.constrain=regex makes vLLM report logprobs of the grammar-"
                "masked distribution, which the trainer cannot reproduce; set "
                "actor.recompute_logprob=true and actor.use_decoupled_loss=false (or constrain "
                "with 'ascii', whose logprobs are the unmasked model's)"
            )
        allowed = set(self.vllm.allowed_media_domains)
        fetchable = set(self.trajectory.allowed_image_hosts)
        for host in self.agent.screenshot_hosts:
            if allowed and host not in allowed and self.endpoint.mode == "direct":
                raise ConfigError(
                    f"screenshot host {host!r} (agent.screenshot_hosts) is not in "
                    f"vllm.allowed_media_domains {sorted(allowed)}: vLLM would refuse the "
                    f"screenshots; add {host!r} to vllm.allowed_media_domains"
                )
            if host not in fetchable:
                raise ConfigError(
                    f"screenshot host {host!r} (agent.screenshot_hosts) is not in "
                    f"trajectory.allowed_image_hosts {sorted(fetchable)}: the converter would "
                    f"refuse its images; add {host!r} to trajectory.allowed_image_hosts"
                )
        if self.endpoint.base_url:
            parts = urlsplit(self.endpoint.base_url)
            if parts.scheme not in ("http", "https") or not parts.path.rstrip("/").endswith("/v1"):
                raise ConfigError(
                    f"endpoint.base_url={self.endpoint.base_url!r} must be an http(s) OpenAI "
                    "base URL ending in /v1, or empty for the engine's own servers"
                )

    def _validate_gateway(self) -> None:
        backend = (self.rollout.backend or "").split(":", 1)[0]
        if backend not in ("vllm", "sglang"):
            raise ConfigError(
                f"endpoint.mode=gateway samples through vLLM or SGLang; rollout.backend is "
                f"{self.rollout.backend!r}: use a vllm or sglang backend, or endpoint.mode=direct"
            )
        if self.gateway.backend == "auto":
            self.gateway.backend = backend
        elif self.gateway.backend != backend and not (
            backend == "vllm" and self.gateway.backend == "text"
        ):
            raise ConfigError(
                f"gateway.backend={self.gateway.backend!r} but rollout.backend is "
                f"{self.rollout.backend!r}: set gateway.backend=auto"
            )
        check_trainer_sampling(self.gconfig, use_lora=bool(getattr(self.actor, "use_lora", False)))
        if not self.gateway.max_connections:
            self.gateway.max_connections = self.rollout.max_concurrent_rollouts or 0
        step_s = self.agent.max_step_time_s
        for warning in (
            pause_warning(self.saver, self.evaluator, step_s, self.gateway.max_pause_wait_s),
            outage_warning(step_s, self.gateway.model_outage_s),
        ):
            if warning:
                log.warning(warning)
        if backend == "sglang":
            return  # SGLang returns logprobs after temperature by default; nothing else to set
        if not self.vllm.enable_scale_out and self.gateway.backend == "vllm":
            raise ConfigError(
                "endpoint.mode=gateway needs vllm.enable_scale_out=true (it serves "
                "/inference/v1/generate, the gateway's tokens-in endpoint); without it, "
                "gateway.backend=text samples from re-tokenised history (prefix breaks)"
            )
        if self.vllm.logprobs_mode != "processed_logprobs":
            raise ConfigError(
                "endpoint.mode=gateway records the logprobs of the distribution it sampled "
                "from: set vllm.logprobs_mode=processed_logprobs"
            )
        if self.endpoint.base_url:
            raise ConfigError(
                "endpoint.base_url points the agent at an external server, which is direct mode: "
                "set endpoint.mode=direct, or empty endpoint.base_url to use the gateway"
            )
        if self.agent.model_options.get("constrain"):
            raise ConfigError(
                "agent.model_options.constrain is the local agent's own sampling; through the "
                "gateway the trainer samples. Drop it (use agent.model_options.parse=lenient to "
                "keep a random model's replies actionable), or use endpoint.mode=direct"
            )

    def _validate_normalisation(self) -> None:
        """AReaL normalises fixed chunks of rows; an episode has a variable number of rows."""
        if self.actor.reward_norm is not None:
            raise FieldError(
                "actor.reward_norm",
                "actor.reward_norm normalises rewards over fixed chunks of gconfig.n_samples rows "
                "(or the whole batch of rows), but an episode gives one row per run of "
                "consistent model calls (one per call for an agent that trims or re-renders "
                "its history), so groups would mix and long episodes would count more: set "
                "actor.reward_norm: null. cua-rl's group filter normalises each group's episode "
                "rewards instead, each episode once (group_norm.mean_level/std_level: group, "
                "the defaults)",
            )
        adv = self.actor.adv_norm
        if adv is not None and "group" in (adv.mean_level, adv.std_level):
            raise FieldError(
                "actor.adv_norm",
                "actor.adv_norm at group level slices fixed chunks of rows, and an episode's "
                "rows vary in number: use mean_level/std_level batch (token-weighted, as the "
                "loss) or null; group-level centring is group_norm's",
            )

    def _validate_step_credit(self) -> None:
        """Step credit adds each token's step advantage to the one AReaL's GAE gives it
        (cua_rl/credit/trainer.py): that is the episode's only at discount 1, lambda 1, with the
        reward passed as it is."""
        if not self.step_credit.enabled:
            return
        a = self.actor
        for key, value, want in (
            ("actor.discount", a.discount, 1.0),
            ("actor.gae_lambda", a.gae_lambda, 1.0),
            ("actor.reward_scaling", a.reward_scaling, 1.0),
            ("actor.reward_bias", a.reward_bias, 0.0),
        ):
            if value != want:
                raise FieldError(
                    key,
                    f"{key}={value} with step_credit.enabled: AReaL's GAE must give every "
                    f"trained token its episode's advantage unchanged for the step advantages "
                    f"added to it to mean what they say; set {key}={want:g} (discount a step's "
                    "return with step_credit.gamma instead)",
                )
        for key in ("mask_no_eos_with_zero", "overlong_reward_penalty"):
            if getattr(a, key):
                raise FieldError(
                    f"actor.{key}",
                    f"actor.{key}=true with step_credit.enabled: it changes a row's reward "
                    "but not its step advantages; set it false or turn step credit off",
                )
        if self.step_credit.key.hashes:
            require_imagehash()

    def validate_curriculum(self) -> None:
        if self.curriculum.kind == "ucb":
            if not self.monitor.enabled:
                raise ConfigError(
                    "curriculum.kind=ucb reads task outcomes from the Training Monitor: set "
                    "monitor.enabled=true (with monitor.db_path or monitor.base_url), or "
                    "curriculum.kind=uniform"
                )
            if self.train_dataset.num_workers:
                raise ConfigError(
                    "curriculum.kind=ucb draws tasks when the trainer asks for them; loader "
                    "workers would draw ahead of the outcomes: set train_dataset.num_workers=0"
                )

    def group_filter(self) -> str:
        """The ``dynamic_filter_fn`` dotted path for ``PPOTrainer.train``."""
        return COMPLETE_VARIED_GROUPS if self.curriculum.drop_zero_variance else COMPLETE_GROUPS

    @property
    def run_name(self) -> str:
        return self.monitor.run_name or f"{self.experiment_name}-{self.trial_name}"

    def model_path(self) -> str:
        return self.actor.path or self.tokenizer_path

    def workflow_settings(
        self,
        *,
        monitor_base_url: str = "",
        monitor_token: str = "",
        phase: str = "train",
        total_steps: int = 0,
        outcome_dir: str = "",
    ) -> WorkflowSettings:
        """Settings for the train workflow, or (``phase`` eval / baseline) the eval workflow."""
        if phase not in ("train", "eval", "baseline"):
            raise ConfigError(f"phase must be train, eval or baseline, not {phase!r}")
        is_eval = phase != "train"
        gconfig = self.eval_gconfig if (is_eval and self.eval_gconfig) else self.gconfig
        return WorkflowSettings(
            gym=self.gym,
            agent=self.agent,
            endpoint=self.endpoint,
            trajectory=self.trajectory,
            reward=self.reward,
            processor_path=self.tokenizer_path or self.actor.path,
            monitor_base_url=monitor_base_url if self.monitor.enabled else "",
            monitor_token=monitor_token if self.monitor.enabled else "",
            monitor_spool_path=self.monitor.spool_path,
            store_episodes=self.monitor.store_episodes,
            training_ref=self.run_name if (self.monitor.enabled and monitor_base_url) else "",
            phase=phase,
            total_steps=total_steps,
            sampling=Sampling.from_gconfig(gconfig),
            gateway=self.gateway,
            outcome_dir=outcome_dir if self.failfast.window else "",
            drain=self.drain,
            pause=self.pause,
            group=GroupSettings(
                size=gconfig.n_samples,
                zero_variance_tol=self.curriculum.zero_variance_tol,
                norm=self.group_norm,
                replay=self.replay,
                training=self.run_name,
                step_credit=self.step_credit,
            ),
        )
