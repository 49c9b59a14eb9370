"""The typed run configuration: one pydantic model per section, every key known.

A run is a YAML recipe plus `a.b.c=value` overrides (see `loader.py`); this module
says what may appear there. Every section forbids unknown keys, every field has a
default that works on a laptop CPU (so an empty config is a valid run), and
`Config` resolves what the user left unset — algorithm presets, the batch-size
invariant, the staleness implied by the rollout mode — before cross-field checks
(`checks.py`) reject contradictions. Fields the user *did* set are never touched:
pydantic's `model_fields_set` tells the two apart, so a saved resolved config
reloads to an equal one.

Plug-point fields hold `package.module:function` strings; `None` means the
registry's default (`furlong plugins` lists them).
"""

from __future__ import annotations

import copy
import difflib
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from furlong.config.checks import check, resolve
from furlong.core.api import PauseMode
from furlong.core.plugins import PLUGIN_PATH_RE

# Choices named once here keep each field on one line: the config reference (tools/claims/reference.py)
# takes a field's description from its trailing comment, which a wrapped line would lose.
Dtype = Literal["float32", "bfloat16", "float16"]
RouterPolicy = Literal["least_inflight", "round_robin", "session_affinity"]
LossReducer = Literal["token_mean", "sample_mean", "constant"]
CorrectionName = Literal["none", "tis", "mis", "icepop", "opsm"]
CorrectionLevel = Literal["token", "sequence", "geometric"]
Transport = Literal["shm", "broadcast", "p2p", "disk", "delta", "cuda_ipc"]


class ConfigError(Exception):
    """One or more problems with a config, each naming its dotted field(s).

    Not a ValueError on purpose: raised inside a pydantic validator it propagates
    as itself instead of being folded into a ValidationError.
    """

    def __init__(self, problems: list[tuple[tuple[str, ...], str]], origin: str = ""):
        self.problems = problems  # [(fields, message)], fields are dotted paths
        self.origin = origin
        super().__init__(self._format())

    @property
    def fields(self) -> list[str]:
        return [f for fields, _ in self.problems for f in fields]

    def _format(self) -> str:
        head = f"invalid config{f' ({self.origin})' if self.origin else ''}: {len(self.problems)} problem(s)"
        return "\n".join([head] + [f"  - {msg}" for _, msg in self.problems])


def check_plugin_path(value: str | None) -> str | None:
    """Syntax only; `registry.load_plugin` checks that the target exists and fits."""
    if value is None or PLUGIN_PATH_RE.match(value):
        return value
    hint = ""
    if ":" not in value and "." in value:
        hint = f"; did you mean {value[: value.rindex('.')] + ':' + value[value.rindex('.') + 1 :]!r}?"
    raise ValueError(f"expected 'package.module:function', got {value!r}{hint}")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


# A plug-point field: `registry.py` maps each one to the Protocol its function must fit.
PluginPath = Annotated[str | None, AfterValidator(check_plugin_path)]
PluginPathItem = Annotated[str, AfterValidator(check_plugin_path)]


class ModelConfig(Section):
    """The policy model: a local HF directory, or a tiny model built locally from arch + size."""

    path: str | None = None  # a local HF model dir; None -> built locally from arch + size
    arch: Literal["qwen3", "llama", "qwen3_moe"] = "qwen3"  # HF architecture of a locally built model
    size: Literal["tiny", "small", "m25"] = "tiny"  # tiny 0.14M, small 3.4M, m25 25.7M parameters
    dtype: Dtype = "float32"  # default of train.dtype and engine.dtype when those are unset
    seed: int = 0  # weight init of a locally built model
    max_positions: int = Field(2048, ge=64, le=131072)  # context length of a locally built model


class MixTask(Section):
    """One synthetic task of a `data.mix`, and the LoRA adapter (`train.lora.adapters`) its prompts train."""

    task: str  # a synthetic task name (furlong/data/tasks.py)
    adapter: str | None = None  # one of train.lora.adapters; None -> the run's single policy
    difficulty: int | None = Field(None, ge=1)  # None -> data.difficulty


class DataConfig(Section):
    """Training and eval prompts: a file or a synthetic task, with field mapping."""

    path: str | None = None  # train file (JSONL / Parquet / HF `datasets` dir); exclusive with `task`
    format: Literal["jsonl", "parquet", "hf", "auto"] = "auto"
    task: str | None = "arithmetic"  # synthetic task name; cleared when `path` is set
    difficulty: int = Field(1, ge=1)  # synthetic tasks: bigger numbers / longer strings
    prompt_key: str = "prompt"  # file field holding the prompt text
    messages_key: str | None = None  # when set, prompts are chat messages read from this key
    label_key: str = "label"  # file field holding the answer the reward checks
    metadata_keys: list[str] = Field(default_factory=list)  # file fields copied into sample.metadata
    eval_path: str | None = None  # held-out file; exclusive with eval_task
    eval_task: str | None = None  # defaults to `task` (its held-out split)
    n_train: int | None = Field(None, ge=1)  # synthetic tasks: train size; files: cap
    n_eval: int = Field(64, ge=1)  # eval prompts
    shuffle: bool = True  # seeded shuffle per epoch
    on_error: Literal["raise", "skip"] = "raise"  # a malformed line: error naming file:line, or skip and count
    apply_chat_template: bool = True  # wrap text prompts as a user message in the chat template
    sft_path: str | None = None  # demonstrations (prompt + response) for the SFT warm-up; None -> the task's answers
    sft_response_key: str = "response"  # field of sft_path holding the demonstrated response
    # Each prompt is tagged with its task's adapter in metadata["adapter"] (a file's rows can carry their own
    # with metadata_keys: [adapter]). n_train and n_eval count all tasks together.
    mix: list[MixTask] = Field(default_factory=list)  # {task, adapter, difficulty}, interleaved; not with task


class RolloutConfig(Section):
    """How samples are produced: the async spectrum, sampling, filters, eval, rollout plug points."""

    mode: Literal["sync", "overlap", "async"] = "sync"  # sync | overlap (one step ahead) | fully async
    rollout_batch_size: int = Field(4, ge=1)  # prompts per step
    n_samples_per_prompt: int = Field(4, ge=1)  # group size
    over_sampling: float = Field(1.0, ge=1.0)  # prompts asked for = ceil(rollout_batch_size * this)
    max_staleness: int = Field(0, ge=0)  # versions; default 0 for sync, 1 for overlap/async
    stale_policy: Literal["drop", "retry"] = "retry"  # a group older than max_staleness
    max_buffer_groups: int | None = Field(
        None, ge=1
    )  # async back-pressure bound (groups the trainer waits for excepted); None -> max(1, max_staleness) batches
    partial_rollout: bool = False  # abort at a weight sync and resume from the tokens so far
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)  # nucleus sampling; 1 = off
    top_k: int = Field(-1, ge=-1)  # -1 = off
    max_new_tokens: int = Field(64, ge=1)  # response budget per sample (all turns together)
    stop: list[str] = Field(default_factory=list)  # stop strings
    dynamic_filter: bool = False  # drop groups whose rewards all agree (zero advantage)
    # Groups dropped in a row (by the filters, any reason), in batches' worth, before the run stops with an error
    # naming the reasons: a saturated reward under dynamic sampling would otherwise draw prompts forever.
    max_dropped_batches: int = Field(10, ge=1)
    max_turns: int = Field(1, ge=1)
    routing_replay: bool = False  # R3: record MoE routing in rollout, replay it in training
    eval_every: int = Field(0, ge=0)  # steps; 0 = never
    eval_n_samples: int = Field(1, ge=1)  # per eval prompt, for pass@k
    rollout_fn: PluginPath = None  # plug point: the whole rollout step
    generate_fn: PluginPath = None  # plug point: one sample through the engines
    agent_fn: PluginPath = None  # plug point: a black-box agent on a TITO session
    reward_fn: PluginPath = None  # plug point: per-sample reward
    group_reward_fn: PluginPath = None  # plug point: per-group reward, instead of reward_fn
    reward_post_fn: PluginPath = None  # plug point: reward shaping over the batch
    dynamic_filter_fn: PluginPath = None  # plug point: keep or drop a group (when dynamic_filter)
    sample_filter_fn: PluginPath = None  # plug point: mask a sample out of the loss
    data_source: PluginPath = None  # plug point: the prompt source factory
    buffer: PluginPath = None  # plug point: the group buffer factory
    eval_fn: PluginPath = None  # plug point: evaluation
    eval_mode: Literal["blocking", "async", "dedicated"] = (
        "blocking"  # eval stops training, runs beside it, or own engine
    )


class EngineConfig(Section):
    """The inference engines behind the router."""

    backend: Literal["builtin", "sglang"] = "builtin"  # builtin PyTorch engine (CPU/GPU) or SGLang (GPU)
    num_engines: int = Field(1, ge=1)  # engine servers behind the router
    eval_num_engines: int = Field(1, ge=1)  # rollout.eval_mode=dedicated: eval's own engines, not behind the router
    dtype: Dtype = "float32"  # rollout weights; unset -> model.dtype
    quantization: Literal["none", "fp8", "mxfp8", "nvfp4", "int4"] = "none"  # rollout weights, quantised at sync
    kv_cache_mb: int = Field(256, ge=1)  # KV-cache budget per engine
    max_running: int = Field(64, ge=1)  # requests decoded together per engine
    max_context: int | None = Field(None, ge=1)  # None -> the model's max positions
    prefix_cache: bool = True
    pause_mode: PauseMode = "retract"  # at a weight sync: requeue, freeze or abort
    host: str = "127.0.0.1"  # engines bind here
    port_base: int = Field(0, ge=0, le=65535)  # engine i listens on port_base + i; 0 = free ports
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")  # auto: cuda:0 when visible, else cpu
    cuda_graphs: bool = False  # builtin on CUDA: replay decode steps as CUDA graphs, one per batch-size bucket
    compile: bool = (
        False  # builtin: torch.compile the decode and mixed steps once per engine process (engine/compiled_step.py)
    )


class RouterConfig(Section):
    """The router in front of the engines: balancing, sessions, health checks, retries."""

    policy: RouterPolicy = "least_inflight"  # how requests pick an engine
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)  # 0 = a free port
    health_interval_s: float = Field(1.0, gt=0)  # seconds between health checks
    health_timeout_s: float = Field(5.0, gt=0)  # a check slower than this fails
    unhealthy_after: int = Field(2, ge=1)  # failed checks before quarantine
    max_retries: int = Field(2, ge=0)  # retries of a request whose engine died, on another engine


class LoraConfig(Section):
    """PEFT LoRA adapters: only adapters train; `sync` says whether engines get adapters or merged weights."""

    enabled: bool = False
    r: int = Field(8, ge=1)  # adapter rank
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    sync: Literal["adapter", "merged"] = "adapter"  # adapter: A, B only (built-in engine); merged: W + B·A·scale
    adapters: list[str] = Field(default_factory=list)  # multi-LoRA: one per name; [] -> a single adapter


class TrainConfig(Section):
    """The trainer: FSDP2 ranks, optimiser, schedule, batches, checkpoints, training plug points."""

    world_size: int = Field(1, ge=1)  # trainer ranks (FSDP2)
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: nccl on GPU, gloo on CPU
    lr: float = Field(1e-5, gt=0)  # AdamW learning rate
    critic_lr: float | None = Field(None, gt=0)  # PPO critic; None -> lr
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    grad_clip: float = Field(1.0, ge=0)  # 0 = off
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"  # after linear warm-up
    warmup_steps: int = Field(0, ge=0)  # optimiser steps
    total_steps: int = Field(100, ge=1)  # RL steps (one rollout batch each)
    micro_batch_tokens: int = Field(2048, ge=1)  # token budget of one padded micro-batch: rows x its longest sample
    global_batch_size: int = Field(16, ge=1)  # samples per optimiser step
    num_steps_per_rollout: int = Field(1, ge=1)  # optimiser steps per rollout batch
    dtype: Literal["float32", "bfloat16"] = "float32"  # parameter dtype in training; unset -> model.dtype
    qat: Literal["none", "int4"] = "none"  # quantisation-aware training of the weights
    gradient_checkpointing: bool = False
    # torch.compile of each decoder layer, forward + backward (train/compiled.py); auto: on CUDA only
    compile: bool | Literal["auto"] = "auto"
    # CPU linears, forward + backward, through oneDNN (train/onednn_linear.py); auto: on x86 CPUs not Intel's
    onednn_linear: bool | Literal["auto"] = "auto"
    ref_update_every: int = Field(0, ge=0)  # RL steps; 0 = the reference model stays frozen
    checkpoint_every: int = Field(50, ge=0)  # RL steps between checkpoints; 0 = by time (or only at the end)
    checkpoint_every_min: float = Field(30.0, ge=0)  # minutes between checkpoints (whichever comes first); 0 = off
    keep_checkpoints: int | None = Field(3, ge=1)  # the newest N complete checkpoints; None = keep all
    max_nonfinite_steps: int = Field(3, ge=1)  # NaN/inf losses in a row before the run stops
    sft_steps: int = Field(0, ge=0)  # SFT warm-up steps before RL
    sft_lr: float | None = Field(None, gt=0)  # learning rate of the SFT warm-up; None -> lr
    lora: LoraConfig = Field(default_factory=LoraConfig)
    loss_fn: PluginPath = None  # plug point: per-token policy loss
    advantage_fn: PluginPath = None  # plug point: advantage estimator (else algo.advantage)
    correction_fn: PluginPath = None  # plug point: off-policy correction (else algo.correction)
    reducer_fn: PluginPath = None  # plug point: loss reducer (else algo.loss_reducer)
    convert_fn: PluginPath = None  # plug point: samples to train batch
    before_train_step: PluginPath = None  # plug point: hook before each optimiser step
    after_save: PluginPath = None  # plug point: hook after each checkpoint
    # bf16 compute, fp32 master weights: FSDP2's policy when world_size > 1 (bf16 all-gathers, fp32 reduce-scatter);
    # autocast on one rank (bf16 matmuls, fp32 norms and log-softmax). See docs/cluster.md
    mixed_precision: Literal["none", "bf16"] = "none"


AlgoName = Literal[
    "grpo", "dr_grpo", "gspo", "dapo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "ppo", "sft", "distill"
]
Advantage = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae", "none"]


class AlgoConfig(Section):
    """The RL algorithm; `name` presets every field you leave unset (see checks.PRESETS)."""

    name: AlgoName = "grpo"
    advantage: Advantage = "grpo"  # derived from `name` unless set
    norm_adv_by_std: bool = True  # divide group-centred rewards by the group std
    gamma: float = Field(1.0, ge=0, le=1)  # discount (gae, reinforce_pp)
    lam: float = Field(0.95, ge=0, le=1)  # GAE lambda
    clip_eps_low: float = Field(0.2, ge=0)  # PPO ratio clip below 1
    clip_eps_high: float = Field(0.2, ge=0)  # PPO ratio clip above 1 (DAPO clip-higher: 0.28)
    dual_clip_c: float | None = Field(None, gt=1)  # dual-clip bound for negative advantages; None = off
    ratio_type: Literal["token", "sequence"] = "token"  # per token, or per sequence (GSPO)
    log_ratio_clamp: float = Field(20.0, gt=0)  # |log ratio| clamp before exp, for stability
    kl_coef: float = Field(0.0, ge=0)  # weight of KL to the reference model; 0 = no reference pass needed
    kl_type: Literal["k1", "k2", "k3"] = "k3"  # KL estimator: k1 log-ratio, k2 squared, k3 low-variance
    kl_in_reward: bool = False  # fold KL into the reward instead of the loss
    entropy_coef: float = Field(0.0, ge=0)  # entropy bonus weight
    loss_reducer: LossReducer = "sample_mean"  # how per-token losses become a scalar
    reducer_constant: float | None = Field(None, gt=0)  # `constant` reducer; None -> rollout.max_new_tokens
    correction: CorrectionName = "none"  # off-policy correction for rollout/train mismatch
    correction_level: CorrectionLevel = "token"  # ratio per token, per sequence, or geometric mean
    correction_mode: Literal["truncate", "mask"] = "truncate"  # clip weights, or mask tokens out of bounds
    correction_low: float = Field(0.5, ge=0)  # lower bound of the importance weight
    correction_high: float = Field(2.0, gt=0)  # upper bound of the importance weight
    vf_coef: float = Field(0.5, ge=0)  # PPO value-loss weight
    value_clip: float = Field(0.2, ge=0)  # PPO value clip
    distill_mode: Literal["advantage", "reverse_kl"] = "advantage"  # teacher as advantage shaping, or reverse KL
    distill_coef: float = Field(1.0, ge=0)  # weight of the distillation term
    teacher_path: str | None = None  # distill: a local HF model dir


class WeightsConfig(Section):
    """Weight sync from trainer to engines."""

    transport: Transport = "shm"  # shm: same node; p2p: per shard; delta: checksummed
    bucket_mb: int = Field(64, ge=1)  # tensors are sent in buckets of this size
    verify: bool = False  # compare engine and trainer checksums after every sync


class ClusterConfig(Section):
    """Where processes run: a local Ray by default, or a Ray cluster by address."""

    address: str | None = None  # None = a local Ray; else a Ray cluster address
    colocate: bool = False  # engines and trainer share devices
    num_cpus: int | None = Field(None, ge=1)  # None = what Ray detects
    num_gpus: int | None = Field(None, ge=0)
    auto_restart: bool = False  # restart a dead trainer from its last checkpoint
    threads_per_process: int | None = Field(None, ge=1)  # None = cores / processes
    # async modes: trainer and engines each take a sync run's threads and time-share the cores: the engines freeze in
    # place while the trainer computes and run at lower priority (nice +engine_niceness); false: split the cores.
    # Off by default: beside other busy programs a two-thread trainer stalls at its OpenMP barriers (docs/async.md)
    share_cores: bool = False
    engine_niceness: int = Field(10, ge=0, le=19)
    # async modes with split cores: the engines compute with a sync run's threads (every core) while the trainer
    # waits for a batch, and with their split share while it computes (`/set_threads` around each train step).
    lend_idle_cores: bool = False  # split cores; the trainer's lent to the engines while it waits (docs/async.md)
    # async modes with split cores: once the engines have generated everything the buffer holds, the trainer computes
    # with a sync run's threads (every core) from its next micro-batch to the end of its step (docs/async.md).
    borrow_idle_cores: bool = False  # split cores; the engines' lent to the trainer while they have nothing to do
    no_engine_timeout_s: float = Field(300.0, gt=0)  # no engine (or router) serving this long: the run stops
    # Ray resources a trainer rank / engine must be placed on (a node's custom resource or `node:<ip>`); rank or
    # engine i takes the i-th name, cycling; empty = wherever Ray puts it. See docs/cluster.md.
    trainer_nodes: list[str] = Field(default_factory=list)
    engine_nodes: list[str] = Field(default_factory=list)


class ObserveConfig(Section):
    """Event store, dashboard and metric sinks."""

    event_store: bool = True  # SQLite event store in the run directory
    dashboard: bool = False  # start the dashboard with the run
    dashboard_port: int = Field(0, ge=0, le=65535)  # 0 = a free port
    tensorboard: bool = True  # TensorBoard logs in runs/<name>/tensorboard
    jsonl: bool = True  # metrics.jsonl in the run directory
    wandb: bool = False  # log to Weights & Biases (needs wandb installed)
    mlflow: bool = False  # log to MLflow (needs mlflow installed)
    project: str = "furlong"  # W&B project / MLflow experiment
    log_every: int = Field(1, ge=1)  # steps between metric logs
    sinks: list[PluginPathItem] = Field(default_factory=list)  # plug points: extra metric sinks


class EnvsConfig(Section):
    """Agentic environments, tools and sandboxes."""

    name: str | None = None  # a built-in environment or connector (calculator, coding, openenv, ...)
    environment: PluginPath = None  # a custom environment factory; exclusive with `name`
    tools: list[str] = Field(default_factory=list)  # tool names offered to the model
    tool_fn: PluginPath = None  # plug point: execute a tool call
    sandbox: Literal["local", "e2b", "daytona"] = "local"  # where untrusted code runs
    sandbox_factory: PluginPath = None  # a custom sandbox provider; overrides `sandbox`
    timeout_s: float = Field(10.0, gt=0)  # per tool call / sandbox run
    memory_mb: int = Field(1024, ge=16)  # sandbox memory limit
    max_output_bytes: int = Field(65536, ge=1)  # sandbox output cap
    network: bool = False  # allow network inside the sandbox
    sandbox_unsafe_allow: bool = False  # run local sandboxes without bwrap namespaces (rlimits + Landlock only)
    connector: dict[str, Any] = Field(default_factory=dict)  # passed through to the connector


SECTIONS: dict[str, type[Section]] = {
    "model": ModelConfig,
    "data": DataConfig,
    "rollout": RolloutConfig,
    "engine": EngineConfig,
    "router": RouterConfig,
    "train": TrainConfig,
    "algo": AlgoConfig,
    "weights": WeightsConfig,
    "cluster": ClusterConfig,
    "observe": ObserveConfig,
    "envs": EnvsConfig,
}


class Config(Section):
    """A whole run: a YAML recipe plus overrides, resolved and checked."""

    name: str = Field("run", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # run name; the run directory is runs/<name>
    seed: int = 0  # master seed: data order, sampling, init
    run_dir: str = "runs/run"  # default runs/<name>
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    observe: ObserveConfig = Field(default_factory=ObserveConfig)
    envs: EnvsConfig = Field(default_factory=EnvsConfig)

    @model_validator(mode="after")
    def _resolve_and_check(self) -> Config:
        problems = resolve(self)
        problems += check(self)
        if problems:
            raise ConfigError(problems)
        return self

    @classmethod
    def from_dict(cls, data: dict[str, Any], origin: str = "") -> Config:
        """Validate a plain dict; every failure becomes one ConfigError naming dotted fields."""
        data = copy.deepcopy(data)
        problems = pop_unknown(data, cls, "")  # first, so pydantic reports only real type errors
        try:
            cfg = cls.model_validate(data)
        except ValidationError as e:
            problems += [_pydantic_problem(err) for err in e.errors()]
        except ConfigError as e:
            problems += e.problems
        if problems:
            raise ConfigError(problems, origin)
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False, width=100)

    def save(self, path: str | Path | None = None) -> Path:
        """Write the resolved config (default `<run_dir>/config.yaml`); loading it gives an equal Config."""
        out = Path(path) if path is not None else Path(self.run_dir) / "config.yaml"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(self.to_yaml())
        return out


def _pydantic_problem(err: dict[str, Any]) -> tuple[tuple[str, ...], str]:
    field = ".".join(str(p) for p in err["loc"]) or "<config>"
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    elif err["type"] != "value_error" and "input" in err and not isinstance(err["input"], (dict, list)):
        msg = f"{msg} (got {err['input']!r})"
    return (field,), f"{field}: {msg}"


# ---------------------------------------------------------------- walking the schema (unknown keys)
def section_type(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = section_type(arg)
        if found is not None:
            return found
    return None


def all_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, info in model.model_fields.items():
        sub = section_type(info.annotation)
        out.append(prefix + name)
        if sub is not None:
            out += all_paths(sub, f"{prefix}{name}.")
    return out


def pop_unknown(raw: dict[str, Any], model: type[BaseModel], prefix: str) -> list[tuple[tuple[str, ...], str]]:
    """Remove unknown keys from `raw` (so pydantic reports only real type errors) and explain each."""
    problems: list[tuple[tuple[str, ...], str]] = []
    fields = model.model_fields
    for key in list(raw):
        dotted = f"{prefix}{key}"
        if key not in fields:
            raw.pop(key)
            problems.append(((dotted,), f"{dotted}: unknown key{did_you_mean(str(key), prefix, list(fields))}"))
            continue
        sub = section_type(fields[key].annotation)
        if sub is not None and isinstance(raw[key], dict):
            problems += pop_unknown(raw[key], sub, dotted + ".")
    return problems


def did_you_mean(key: str, prefix: str, siblings: list[str]) -> str:
    close = difflib.get_close_matches(key, siblings, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {prefix}{close[0]}?"
    elsewhere = [p for p in all_paths(Config) if p.rsplit(".", 1)[-1] == key]
    if not elsewhere:
        leaves = {p.rsplit(".", 1)[-1]: p for p in all_paths(Config)}
        elsewhere = [leaves[m] for m in difflib.get_close_matches(key, list(leaves), n=1, cutoff=0.75)]
    if elsewhere:
        return f"; did you mean {' or '.join(elsewhere)}?"
    return f"; known keys here: {', '.join(siblings)}"
