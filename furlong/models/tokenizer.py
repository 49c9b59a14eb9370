"""A byte-level BPE tokenizer trained locally in a fraction of a second.

Why train one instead of shipping a vocab: nothing in furlong may download from a
model hub, and a few-hundred-token vocab keeps the embedding of a tiny model
small so a CPU run learns quickly. The vocab is trained on text shaped like
what the synthetic tasks and the chat template produce, so digits, operators
and role names become single tokens.
"""

from __future__ import annotations

import random

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from furlong.models.templates import FAMILY_STYLES, Style

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END]
# Tool-call markers are ordinary added tokens (not "special"): the model must be
# able to emit them and `skip_special_tokens` must keep them in decoded text.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# ChatML with tools. A tool call is rendered as <tool_call>{json}</tool_call>,
# a tool result as a `tool` turn wrapped in <tool_response>. Tools are listed as
# compact signatures, `- name(arg, ...): description`, not as JSON schemas: a schema
# costs a ~500-token vocab over a hundred tokens per tool, which a tiny model would
# have to attend across on every turn (and a CPU trainer pay for on every sample).
CHAT_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "Tools:\n{% for tool in tools %}{% set f = tool.function if tool.function is defined else tool %}"
    "- {{ f.name }}("
    "{% if f.parameters is defined and f.parameters.properties is defined %}"
    "{{ f.parameters.properties | list | join(', ') }}{% endif %})"
    "{{ ': ' ~ f.description if f.description else '' }}\n{% endfor %}"
    'Use <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' %}"
    "{% if not tools %}<|im_start|>system\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% elif message.role == 'tool' %}"
    "<|im_start|>tool\n<tool_response>{{ message.content }}</tool_response><|im_end|>\n"
    "{% elif message.role == 'assistant' %}"
    "<|im_start|>assistant\n{{ message.content or '' }}"
    "{% for tc in message.tool_calls or [] %}"
    "{% set f = tc.function if tc.function is defined else tc %}"
    '<tool_call>{"name": "{{ f.name }}", "arguments": '
    "{% if f.arguments is string %}{{ f.arguments }}{% else %}{{ f.arguments | tojson }}{% endif %}"
    "}</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Qwen3 style: ChatML whose assistant turns before the last user message lose their <think> block. Real
# Qwen3 templates do this, so it does NOT continue token-in-token-out (`furlong tito check` says so).
QWEN3_THINKING_TEMPLATE = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' %}"
    "{% set content = message.content or '' %}"
    "{% if loop.index0 < ns.last_user and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip('\n') %}{% endif %}"
    "<|im_start|>assistant\n{{ content }}"
    "{% for tc in message.tool_calls or [] %}{% set f = tc.function if tc.function is defined else tc %}"
    '<tool_call>{"name": "{{ f.name }}", "arguments": '
    "{% if f.arguments is string %}{{ f.arguments }}{% else %}{{ f.arguments | tojson }}{% endif %}"
    "}</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "<|im_start|>tool\n<tool_response>{{ message.content }}</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def styles() -> dict[str, Style]:
    """Every template style a tokenizer can be built with: ChatML (default), Qwen3 thinking, the other families."""
    chatml = Style("chatml", tuple(SPECIAL_TOKENS), EOS, IM_END, CHAT_TEMPLATE, "hermes", added=tuple(TOOL_TOKENS))
    qwen3 = Style(
        "qwen3_thinking",
        tuple(SPECIAL_TOKENS),
        EOS,
        IM_END,
        QWEN3_THINKING_TEMPLATE,
        "hermes",
        added=(*TOOL_TOKENS, "<think>", "</think>"),
    )
    return {"chatml": chatml, "qwen3_thinking": qwen3, **FAMILY_STYLES}


def _corpus(seed: int, n: int = 4000) -> list[str]:
    """Text shaped like furlong's tasks and chat turns, for BPE merges."""
    rng = random.Random(seed)
    words = (
        "the a of to and is in what compute reverse sort answer question result tool calculator "
        "system user assistant please number string letters sum product difference plus minus times "
        "equals call name arguments expression value you are helpful step think final"
    ).split()
    out = []
    for _ in range(n):
        kind = rng.randrange(5)
        if kind == 0:
            a, b = rng.randrange(1000), rng.randrange(1000)
            out.append(f"What is {a} {rng.choice('+-*')} {b}? Answer: {a + b}")
        elif kind == 1:
            s = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randrange(3, 9)))
            out.append(f"Reverse the string {s}. Answer: {s[::-1]}")
        elif kind == 2:
            out.append(" ".join(rng.choice(words) for _ in range(rng.randrange(4, 16))))
        elif kind == 3:
            out.append(
                f'{{"name": "calculator", "arguments": {{"expression": "{rng.randrange(99)}*{rng.randrange(99)}"}}}}'
            )
        else:
            out.append(
                f"{IM_START}user\n{' '.join(rng.choice(words) for _ in range(6))}{IM_END}\n{IM_START}assistant\n"
            )
    return out


def build_tokenizer(vocab_size: int = 512, seed: int = 0, style: str = "chatml") -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer and wrap it for `transformers`, with `style`'s tokens and template."""
    all_styles = styles()
    if style not in all_styles:
        raise ValueError(f"--template: unknown template style {style!r}; choose one of {list(all_styles)}")
    st = all_styles[style]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(st.added),
        special_tokens=list(st.special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in st.added])
    # padding_side and chat_template go to the constructor, or save_pretrained drops them.
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=st.eos,
        pad_token=st.eos,
        bos_token=st.bos,
        unk_token=None,
        padding_side="left",
        chat_template=st.template,
        model_max_length=2048,
    )
