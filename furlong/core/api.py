"""Request bodies of the engine's HTTP API, validated strictly.

Every body is a pydantic model with `extra="forbid"`: an unknown or wrong-typed
field is a 400 whose message names the field (`BadRequest`), never a 5xx or a
silently ignored typo. Limits that depend on the loaded model (vocabulary,
context, KV budget) are checked in `check_prompt` / `check_sampling`.
"""

from __future__ import annotations

import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# How an engine treats requests in flight at `/pause_generation` (SGLang's modes):
#   abort     end them now (finish reason "abort"); the client resubmits what it wants
#   retract   requeue them; they resume from their tokens after `/continue_generation`
#   in_place  freeze them where they stand, KV cache kept
PauseMode = Literal["retract", "in_place", "abort"]
PAUSE_MODES: tuple[str, ...] = typing.get_args(PauseMode)

# The engine HTTP API's paths, one name each (SGLang's native spelling).
GENERATE = "/generate"
HEALTH = "/health"
HEALTH_GENERATE = "/health_generate"
MODEL_INFO = "/get_model_info"
METRICS = "/metrics"
ABORT = "/abort_request"
PAUSE = "/pause_generation"
CONTINUE = "/continue_generation"
FLUSH_CACHE = "/flush_cache"
UPDATE_FROM_TENSOR = "/update_weights_from_tensor"
INIT_GROUP = "/init_weights_update_group"
UPDATE_FROM_DISTRIBUTED = "/update_weights_from_distributed"
UPDATE_FROM_DISK = "/update_weights_from_disk"
DESTROY_GROUP = "/destroy_weights_update_group"
WEIGHT_CHECKSUMS = "/get_weights_checksum"
WEIGHT_VERSION = "/get_weight_version"
SERVER_INFO = "/get_server_info"
TOKENIZE = "/tokenize"
DETOKENIZE = "/detokenize"
LOAD_LORA = "/load_lora_adapter"
UNLOAD_LORA = "/unload_lora_adapter"
SET_THREADS = "/set_threads"  # furlong's own: the CPU threads an engine computes with (`cluster.lend_idle_cores`)
# Endpoints that change what an engine serves: they require the run's admin token.
CONTROL_PATHS = (
    ABORT,
    PAUSE,
    CONTINUE,
    FLUSH_CACHE,
    UPDATE_FROM_TENSOR,
    UPDATE_FROM_DISK,
    UPDATE_FROM_DISTRIBUTED,
    INIT_GROUP,
    DESTROY_GROUP,
    WEIGHT_CHECKSUMS,
    LOAD_LORA,
    UNLOAD_LORA,
    SET_THREADS,
)

# Adapter-only LoRA sync: adapter tensors travel through every weight transport under these names, beside
# (never among) the model's own parameter names: `lora::<adapter>::<HF module>.lora_A` ([r, in]),
# `...lora_B` ([out, r]) and one `lora::<adapter>::config` tensor [scaling, number of modules].
LORA_TENSOR_PREFIX = "lora::"


def lora_tensor_name(adapter: str, module: str, part: str) -> str:
    """`part`: lora_A | lora_B, or "config" with `module` empty."""
    head = f"{LORA_TENSOR_PREFIX}{adapter}::"
    return f"{head}config" if part == "config" else f"{head}{module}.{part}"


def parse_lora_tensor_name(name: str) -> tuple[str, str, str] | None:
    """(adapter, module, part) of an adapter tensor name; None for a model parameter name."""
    if not name.startswith(LORA_TENSOR_PREFIX):
        return None
    adapter, _, rest = name[len(LORA_TENSOR_PREFIX) :].partition("::")
    if rest == "config":
        return adapter, "", "config"
    module, _, part = rest.rpartition(".")
    return adapter, module, part


MAX_N = 16
MAX_STOP = 16
MAX_TOP_LOGPROBS = 20


class BadRequest(ValueError):
    """A client error: rendered as HTTP 400 (or `status`, e.g. 413) with `param` naming the field."""

    def __init__(self, param: str, message: str, status: int = 400):
        super().__init__(f"{param}: {message}" if param else message)
        self.param = param
        self.status = status


def validation_error(e: ValidationError) -> BadRequest:
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err["loc"] if not str(x).startswith("function-")) or "body"
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        msg = "unknown field"
    return BadRequest(loc, msg)


def parse(model: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise BadRequest("body", "must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _check_stop(cls, v):
    """`stop`: one string or a list of at most MAX_STOP non-empty strings."""
    v = [v] if isinstance(v, str) else v
    if v is not None and (len(v) > MAX_STOP or any(not s for s in v)):
        raise ValueError(f"at most {MAX_STOP} non-empty strings")
    return v


class SamplingParamsIn(Strict):
    max_new_tokens: int | None = Field(None, strict=True, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, strict=True, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = Field(None, strict=True, ge=0, lt=2**63)
    sampling_seed: int | None = Field(None, strict=True, ge=0, lt=2**63)
    n: int = Field(1, strict=True, ge=1, le=MAX_N)
    spaces_between_special_tokens: bool = True

    _stop = field_validator("stop")(_check_stop)


class GenerateIn(Strict):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParamsIn | None = None
    return_logprob: bool = False
    logprob_start_len: int = Field(-1, strict=True, ge=-1)
    top_logprobs_num: int = Field(0, strict=True, ge=0, le=MAX_TOP_LOGPROBS)
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None
    stream: bool = False
    return_routed_experts: bool = False
    lora_path: str | None = None
    # SGLang's request priority: larger values are scheduled first (SGLang honours it under
    # --enable-priority-scheduling); eval requests beside training (`rollout.eval_mode`) send -1.
    priority: int | None = Field(None, strict=True)


class LoadLoraIn(Strict):
    """SGLang's `/load_lora_adapter`: a PEFT adapter directory (adapter_config.json + adapter_model.safetensors)."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    pinned: bool = False  # SGLang's: keep in GPU memory; the built-in engine keeps every adapter resident


class UnloadLoraIn(Strict):
    lora_name: str = Field(min_length=1)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class OpenAICommon(Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, strict=True, ge=0)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, strict=True, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    n: int = Field(1, strict=True, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, strict=True, ge=0, lt=2**63)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0)
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0)
    # Token-in-token-out extensions (vLLM names; NeMo Gym / Harbor / verifiers read them).
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    rid: str | None = None

    _stop = field_validator("stop")(_check_stop)


class ChatIn(OpenAICommon):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, strict=True, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, strict=True, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False
    add_generation_prompt: bool = True


class CompletionIn(OpenAICommon):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, strict=True, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None


class TokenizeIn(Strict):
    model: str | None = None
    prompt: str | None = None
    text: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeIn(Strict):
    model: str | None = None
    tokens: list[int]
    skip_special_tokens: bool = False


class AbortIn(Strict):
    rid: str | None = None
    abort_all: bool = False


class PauseIn(Strict):
    mode: PauseMode = "abort"


class SetThreadsIn(Strict):
    threads: int = Field(strict=True, ge=1, le=4096)


class UpdateFromTensorIn(Strict):
    shm: dict[str, Any]
    weight_version: int | str | None = None
    flush_cache: bool = True
    load_format: str | None = None


class UpdateFromDiskIn(Strict):
    model_path: str
    weight_version: int | str | None = None
    load_format: str | None = None
    flush_cache: bool = True


class InitGroupIn(Strict):
    master_address: str
    master_port: int = Field(strict=True, gt=0, lt=65536)
    rank_offset: int = Field(1, strict=True, ge=1)
    world_size: int = Field(strict=True, ge=2)
    group_name: str = "weight_update_group"
    backend: str = "gloo"
    timeout_s: float = Field(60.0, gt=0, le=3600)


class UpdateFromDistributedIn(Strict):
    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    weight_version: int | str | None = None
    flush_cache: bool = True
    load_format: str | None = None


def version(v: int | str | None, field: str = "weight_version") -> int | None:
    """Weight versions are integers (every token is stamped with one); numeric strings are accepted."""
    if v is None:
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        raise BadRequest(field, f"must be an integer, got {v!r}") from None
