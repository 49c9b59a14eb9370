"""Every plug point of furlong, declared once: its config key, its typed signature, its default.

A plug point is a `package.module:function` string in the config (a class works
where the plug point builds an object). `load_plugin` imports it and checks it
against the plug point's Protocol *at start*, so a typo or a function with the
wrong shape fails before any engine starts, with an error that names the config
key, the path and the reason — not as a TypeError deep inside step 37.

What "fits" means: furlong calls the function with the Protocol's positional
arguments in order (names are free), passes its keyword-only arguments by name
(the function must accept each, or take **kwargs), and never passes anything else,
so any other parameter must have a default. `calling` says whether furlong awaits
the function (`async`), calls it plainly (`sync`), or takes both (`either`: a plain
function runs on the event loop, so slow ones should be async). A plug point may
also *offer* context (e.g. `config`, `seed`): the function receives each offered
name only if it declares it.

`docs/plug-points.md` is generated from `PLUG_POINTS` (`furlong plugins --markdown`).
Annotations are strings so listing the plug points never imports torch.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from furlong.config.protocols import (  # noqa: F401 - the Protocols are part of the registry's table
    BUILT_OBJECTS,
    AdvantageFn,
    AfterSaveFn,
    AgentFn,
    BeforeTrainStepFn,
    Buffer,
    BufferFactory,
    ConvertFn,
    CorrectionFn,
    DataSourceFactory,
    DynamicFilterFn,
    Environment,
    EnvironmentFactory,
    EvalFn,
    GenerateFn,
    GroupRewardFn,
    LoggingSink,
    LossFn,
    ReducerFn,
    RewardFn,
    RewardPostFn,
    RolloutFn,
    SampleFilterFn,
    Sandbox,
    SandboxFactory,
    SinkFactory,
    ToolFn,
)
from furlong.config.schema import ConfigError
from furlong.core.plugins import PluginError, import_path

if TYPE_CHECKING:
    from furlong.config.schema import Config


# ---------------------------------------------------------------- the registry
@dataclass(frozen=True)
class PlugPoint:
    name: str
    key: str  # dotted config key
    protocol: type
    doc: str
    default: str | None = None  # dotted path; None: built in elsewhere (see doc) or not written yet
    calling: Literal["async", "sync", "either"] = "sync"
    offers: tuple[str, ...] = ()  # keyword context given only to functions that declare it
    many: bool = False  # the config holds a list of paths

    def signature(self) -> str:
        """`[async] def reward(sample: Sample) -> float | dict[str, float]`, from the Protocol."""
        prefix = {"async": "async def", "sync": "def", "either": "[async] def"}[self.calling]
        return _render(self.protocol.__call__, self.name, prefix)


def _render(fn: Callable[..., Any], name: str, prefix: str) -> str:
    """A signature as written in source; annotations stay strings, so nothing heavy is imported."""
    sig = inspect.signature(fn)
    parts, star = [], False
    for p in list(sig.parameters.values())[1:]:  # drop self
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        parts.append(f"{p.name}: {p.annotation}" if p.annotation is not p.empty else p.name)
    return f"{prefix} {name}({', '.join(parts)}) -> {sig.return_annotation}"


_R, _T, _E, _O = "rollout", "train", "envs", "observe"
PLUG_POINTS: tuple[PlugPoint, ...] = (
    PlugPoint(
        "rollout",
        f"{_R}.rollout_fn",
        RolloutFn,
        "Produce one step's groups of samples, replacing the built-in generate -> reward -> filter pipeline.",
        calling="async",
    ),
    PlugPoint(
        "generate",
        f"{_R}.generate_fn",
        GenerateFn,
        "Extend one sample through the engines and set its status; also resumes a partial rollout.",
        "furlong.rollout.generate:generate",
        calling="async",
    ),
    PlugPoint(
        "agent",
        f"{_R}.agent_fn",
        AgentFn,
        "Drive a black-box agent against an OpenAI-compatible base_url (a TITO session); may return its reward.",
        calling="async",
    ),
    PlugPoint(
        "reward",
        f"{_R}.reward_fn",
        RewardFn,
        "Score one finished sample: a float, or a dict whose 'score' key is the reward.",
        "furlong.rollout.rewards:task_reward",
        calling="either",
    ),
    PlugPoint(
        "group_reward",
        f"{_R}.group_reward_fn",
        GroupRewardFn,
        "Score a whole group at once (pairwise or ranking rewards); used instead of the per-sample reward.",
        calling="either",
    ),
    PlugPoint(
        "reward_post_process",
        f"{_R}.reward_post_fn",
        RewardPostFn,
        "Turn a batch's rewards into the scalars advantages use (shaping, length penalty, normalisation).",
        calling="either",
    ),
    PlugPoint(
        "dynamic_filter",
        f"{_R}.dynamic_filter_fn",
        DynamicFilterFn,
        "Keep (None/True) or drop (False or a reason string, counted) a finished group.",
        "furlong.rollout.filters:zero_variance",
        calling="either",
    ),
    PlugPoint(
        "sample_filter",
        f"{_R}.sample_filter_fn",
        SampleFilterFn,
        "Mask one sample out of the loss (False or a reason) while keeping it in its group.",
        calling="either",
    ),
    PlugPoint(
        "data_source",
        f"{_R}.data_source",
        DataSourceFactory,
        "Build the prompt source (next_batch, push_back, state_dict, load_state_dict).",
        offers=("config", "seed"),
    ),
    PlugPoint(
        "buffer",
        f"{_R}.buffer",
        BufferFactory,
        "Build the bounded buffer of groups between rollout and training.",
        "furlong.rollout.buffer:GroupBuffer",
        offers=("config",),
    ),
    PlugPoint(
        "eval",
        f"{_R}.eval_fn",
        EvalFn,
        "Evaluate the policy on held-out (prompt, prompt ids) pairs; returns metrics such as eval/pass@k.",
        "furlong.rollout.eval:evaluate",
        calling="either",
        offers=("n_samples", "sampling_params", "reward_fn", "generate_fn", "seed", "step"),
    ),
    PlugPoint(
        "loss",
        f"{_T}.loss_fn",
        LossFn,
        "Per-token policy loss [B, T] and metrics (before correction weights and the reducer).",
        "furlong.train.losses.policy:ppo_clip_loss",
    ),
    PlugPoint(
        "advantage",
        f"{_T}.advantage_fn",
        AdvantageFn,
        "Advantages [B, T] (and returns or None) from rewards [B]; unset: the estimator named by algo.advantage.",
    ),
    PlugPoint(
        "correction",
        f"{_T}.correction_fn",
        CorrectionFn,
        "Off-policy correction weights [B, T] for rollout/train mismatch; unset: the one named by algo.correction.",
    ),
    PlugPoint(
        "reducer",
        f"{_T}.reducer_fn",
        ReducerFn,
        "Reduce per-token losses [B, T] to a scalar; unset: the one named by algo.loss_reducer.",
    ),
    PlugPoint(
        "convert",
        f"{_T}.convert_fn",
        ConvertFn,
        "Convert a step's samples into the padded train batch.",
        "furlong.train.batch:TrainBatch.from_samples",
    ),
    PlugPoint(
        "before_train_step",
        f"{_T}.before_train_step",
        BeforeTrainStepFn,
        "Hook called before each optimiser step with its batch.",
    ),
    PlugPoint(
        "after_save",
        f"{_T}.after_save",
        AfterSaveFn,
        "Hook called after a checkpoint is written (e.g. copy it elsewhere).",
    ),
    PlugPoint(
        "tool",
        f"{_E}.tool_fn",
        ToolFn,
        "Execute one tool call parsed from the model's output; returns the tool's text.",
        calling="either",
    ),
    PlugPoint(
        "environment",
        f"{_E}.environment",
        EnvironmentFactory,
        "Build a custom agentic environment (reset / step / reward).",
        offers=("config", "seed"),
    ),
    PlugPoint(
        "sandbox",
        f"{_E}.sandbox_factory",
        SandboxFactory,
        "Build a custom sandbox provider for untrusted code; overrides envs.sandbox.",
        offers=("config",),
    ),
    PlugPoint(
        "logging_sink",
        f"{_O}.sinks",
        SinkFactory,
        "Build an extra metrics sink (log / close); a list, each entry one sink.",
        offers=("config",),
        many=True,
    ),
)

BY_KEY: dict[str, PlugPoint] = {p.key: p for p in PLUG_POINTS}
BY_NAME: dict[str, PlugPoint] = {p.name: p for p in PLUG_POINTS}


def get(key_or_name: str) -> PlugPoint:
    found = BY_KEY.get(key_or_name) or BY_NAME.get(key_or_name)
    if found is None:
        hint = difflib.get_close_matches(key_or_name, list(BY_KEY) + list(BY_NAME), n=1)
        raise KeyError(f"no plug point {key_or_name!r}" + (f"; did you mean {hint[0]!r}?" if hint else ""))
    return found


def load_plugin(key: str, path: str | None = None) -> Callable[..., Any]:
    """Import `path` (default: the plug point's default) and check it fits; raises PluginError."""
    point = get(key)
    return _load(point, point.default if path is None else path, point.key)


def _load(point: PlugPoint, path: str | None, shown_key: str) -> Callable[..., Any]:
    if path is None:
        raise PluginError(shown_key, "None", "no path given and this plug point has no default")
    return _fit(point, path, import_path(path, shown_key), shown_key)


def _entries(cfg: Config, point: PlugPoint) -> list[tuple[str, str | None]]:
    """(key as shown in errors, path or None) for each function a config gives this plug point."""
    section, field = point.key.split(".")
    value = getattr(getattr(cfg, section), field)
    if point.many:
        return [(f"{point.key}[{i}]", p) for i, p in enumerate(value)]
    return [(point.key, point.default if value is None else value)]


def resolve(cfg: Config, key: str) -> Any:
    """One plug point of a config, loaded: its own path (a list for `many`), else the default, else None."""
    point = get(key)
    fns = [None if path is None else _load(point, path, shown) for shown, path in _entries(cfg, point)]
    return fns if point.many else fns[0]


def load_all(cfg: Config) -> dict[str, Any]:
    """Every plug point of a config (config key -> what `resolve` gives), loaded and checked at start.

    One ConfigError lists every bad path, so a recipe with three typos fails once, not three times.
    """
    loaded: dict[str, Any] = {}
    problems: list[tuple[tuple[str, ...], str]] = []
    for point in PLUG_POINTS:
        fns = []
        for shown, path in _entries(cfg, point):
            try:
                fns.append(None if path is None else _load(point, path, shown))
            except PluginError as e:
                problems.append(((point.key,), str(e)))
        loaded[point.key] = fns if point.many else (fns or [None])[0]
    if problems:
        raise ConfigError(problems, "plug points")
    return loaded


def _is_async(fn: Any) -> bool:
    if inspect.isclass(fn):
        return False
    # B004 misreads this: __call__ is fetched to ask whether it is async, not whether fn is callable
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004


def _fit(point: PlugPoint, path: str, fn: Any, key: str) -> Callable[..., Any]:
    """Check `fn` against the plug point's Protocol; return it, narrowed to the context it declares."""
    expected = point.signature()
    if not callable(fn):
        raise PluginError(key, path, f"{type(fn).__name__} object is not callable", expected)
    if point.calling == "async" and not _is_async(fn):
        raise PluginError(key, path, "must be a coroutine function (async def): furlong awaits it", expected)
    if point.calling == "sync" and _is_async(fn):
        raise PluginError(key, path, "must be a plain function, not async: furlong calls it without awaiting", expected)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: nothing more to check
        return fn
    proto = list(inspect.signature(point.protocol.__call__).parameters.values())[1:]
    positional = [p.name for p in proto if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keywords = [p.name for p in proto if p.kind is p.KEYWORD_ONLY]
    params = list(sig.parameters.values())
    takes_var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    slots = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(slots) < len(positional) and not any(p.kind is p.VAR_POSITIONAL for p in params):
        raise PluginError(
            key,
            path,
            f"takes {len(slots)} positional parameter(s) ({', '.join(p.name for p in slots) or 'none'}) "
            f"but furlong passes {len(positional)} ({', '.join(positional)})",
            expected,
        )
    extra = slots[len(positional) :]
    rest = {p.name: p for p in extra if p.kind is not p.POSITIONAL_ONLY}  # what a keyword can reach
    for p in extra:
        if p.kind is p.POSITIONAL_ONLY and p.default is p.empty:
            raise PluginError(
                key, path, f"requires positional parameter {p.name!r}, which furlong never passes", expected
            )
    rest.update({p.name: p for p in params if p.kind is p.KEYWORD_ONLY})
    for name in keywords:
        if name not in rest and not takes_var_kw:
            raise PluginError(key, path, f"does not accept the keyword argument {name!r} that furlong passes", expected)
    accepted = [n for n in point.offers if n in rest or takes_var_kw]
    for p in rest.values():
        if p.default is p.empty and p.name not in keywords and p.name not in accepted:
            given = ", ".join(positional + keywords + list(point.offers)) or "nothing"
            raise PluginError(
                key, path, f"requires parameter {p.name!r}, which furlong never passes (it passes: {given})", expected
            )
    if not point.offers or len(accepted) == len(point.offers):
        return fn
    return _offering(fn, frozenset(accepted))


def _offering(fn: Callable[..., Any], accepted: frozenset[str]) -> Callable[..., Any]:
    """Wrap `fn` so that callers may pass every offered keyword; `fn` sees only those it declares."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **{k: v for k, v in kwargs.items() if k in accepted})

    async def acall(*args: Any, **kwargs: Any) -> Any:  # stays a coroutine function for callers that check
        return await call(*args, **kwargs)

    wrapper = acall if _is_async(fn) else call
    functools.update_wrapper(wrapper, fn, assigned=("__module__", "__name__", "__qualname__", "__doc__"), updated=())
    return wrapper


def markdown() -> str:
    """The plug-points docs page (docs/plug-points.md), generated from PLUG_POINTS."""
    lines = [
        "<!-- Generated by `furlong plugins --markdown > docs/plug-points.md`; do not edit by hand. -->",
        "",
        "# Plug points",
        "",
        # the count marker lets the docs claim checker (tools.claims) verify the number against the code
        f"furlong has **<!-- count:plug_points -->{len(PLUG_POINTS)}<!-- /count --> plug points**. "
        "Each is a config key that takes a dotted path",
        "`package.module:function` (a class works where the plug point builds an object), for example",
        "",
        "```yaml",
        "rollout:",
        "  reward_fn: my_project.rewards:exact_match",
        "```",
        "",
        "or on the command line: `furlong train recipe.yaml rollout.reward_fn=my_project.rewards:exact_match`.",
        "",
        "Every path is imported and checked against its signature when the run starts: a wrong module,",
        "a missing attribute, something not callable or a signature that does not fit stops the run",
        "with an error naming the config key, the path and the reason.",
        "",
        "How a function fits its signature: furlong passes the positional arguments in the order shown",
        "(names are free) and the keyword-only arguments (after `*`) by name, and nothing else, so any",
        "other parameter needs a default. `async def` plug points must be coroutine functions, `def` ones",
        "must not be, and `[async] def` ones may be either (a plain function runs on the event loop, so",
        "a slow one should be async). *Offered* context is passed only to functions that declare it.",
        "",
        "| plug point | config key | calling | default |",
        "|---|---|---|---|",
    ]
    for p in PLUG_POINTS:  # signatures hold `|`, which tables render differently on GitHub and mkdocs
        default = f"`{p.default}`" if p.default else "—"
        lines.append(f"| [{p.name}](#{p.name.replace('_', '-')}) | `{p.key}` | {p.calling} | {default} |")
    for p in PLUG_POINTS:
        lines += ["", f"## {p.name.replace('_', '-')}", "", p.doc, "", "```python", p.signature(), "```", ""]
        lines.append(f"- config key: `{p.key}`" + (" (a list of paths)" if p.many else ""))
        lines.append(f"- default: `{p.default}`" if p.default else "- default: none")
        if p.offers:
            lines.append(f"- offered context (keyword, only if declared): {', '.join(f'`{o}`' for o in p.offers)}")
    lines += [
        "",
        "## objects",
        "",
        "What the factory plug points build. A data source follows `furlong.data.PromptSource`",
        "(`next_batch`, `push_back`, `state_dict`, `load_state_dict`); the others follow:",
    ]
    for proto in BUILT_OBJECTS:
        lines += ["", f"### {proto.__name__}", "", inspect.getdoc(proto) or "", "", "```python"]
        for name, member in vars(proto).items():
            if (inspect.isfunction(member) and not name.startswith("_")) or name == "__len__":
                lines.append(_render(member, name, "async def" if inspect.iscoroutinefunction(member) else "def"))
        lines.append("```")
    return "\n".join(lines) + "\n"
