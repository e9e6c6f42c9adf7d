"""Chat turns as token ids: render only what is new, and refuse templates that rewrite the past.

A multi-turn episode is one token sequence, and that sequence is authoritative: the prompt ids
(the first messages rendered with the generation prompt), then the ids the policy sampled (as
sampled: a chat model's turn ends with its end-of-turn token, e.g. `<|im_end|>`, or stops without
it when a stop string or max_tokens ended it), then the ids of what the environment says next,
then the policy's next turn, and so on. The trainer trains on exactly these ids, so they must be
the ids the policy sampled and was conditioned on. Earlier text is never tokenised again (that
can change the tokens: BPE merges across the old boundary, a template that rewrites earlier
turns); each turn only appends the ids of its new part.

The rule: the chat template must be append-only. Rendering the conversation with the new messages
must start with the rendering of the conversation so far, and with the text the episode's ids
decode to. Templates that drop earlier turns' reasoning (Qwen3 drops `<think>...</think>` from
earlier assistant turns), keep only the last N messages, put a turn counter in the system prompt
or trim the assistant's content are refused with `TemplateNotAppendOnly`, naming the model, the
turn and where the text changed. The fix is a template that only appends, or building the turn's
text yourself (`episode.append_text`).

Use:

    ids = chat_prompt_ids(tokenizer, messages, model)                  # the episode's prompt
    ...  # the policy samples; messages.append({"role": "assistant", "content": decode(sampled, skip_special_tokens=True)})
    ids += sampled
    ids += chat_turn_ids(tokenizer, messages, ids, [{"role": "user", "content": reply}], model, turn=1)
    messages.append({"role": "user", "content": reply})

Bridging the sampled ids to the rendering: the sampled ids decode (special tokens kept) to e.g.
`answer<|im_end|>`, while the template renders `answer<|im_end|>\\n<|im_start|>user\\n...`; the ids
appended are those of the rendering past the decoded sequence (`\\n<|im_start|>user\\n...`). When
the turn stopped without its end-of-turn token (a stop string, max_tokens), the decoded sequence
ends at `answer` and the appended part carries `<|im_end|>\\n` too, so the sequence stays the
template's rendering. The appended text is tokenised with `add_special_tokens=False` and special
tokens not split: `<|im_start|>` in it becomes the special token's id, as the template means it.
"""

from __future__ import annotations

from typing import Any

from rl_engine.errors import UserError

_EXCERPT = 30  # characters of context either side of the first difference


class TemplateNotAppendOnly(UserError):
    """Appending a chat turn would change earlier tokens (the template rewrites the past)."""


def chat_prompt_ids(
    tokenizer, messages: list[dict], model: str, *, template_kwargs: dict[str, Any] | None = None
) -> list[int]:
    """The ids of an episode's prompt: `messages` rendered with the generation prompt."""
    return _encode(tokenizer, _render(tokenizer, messages, True, model, template_kwargs))


def chat_turn_ids(
    tokenizer,
    messages: list[dict],
    sequence_ids: list[int],
    new_messages: list[dict],
    model: str,
    turn: int,
    add_generation_prompt: bool = True,
    *,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The token ids to append to `sequence_ids` so that it becomes the rendering of messages +
    new_messages (with the generation prompt), rendering only what is new.

    `messages` is the conversation so far as the template sees it (assistant contents = the
    decoded text of what the policy sampled, special tokens skipped); `sequence_ids` the episode's
    ids so far (prompt + sampled + earlier appended). `model` (e.g. the model path) and `turn`
    name the failure in the error. `template_kwargs` go to `apply_chat_template` (e.g. `tools`).
    Raises TemplateNotAppendOnly when the rendering of the conversation so far, or the text the
    sequence decodes to, is not a prefix of the new rendering.
    """
    before = _render(tokenizer, messages, False, model, template_kwargs)
    after = _render(tokenizer, list(messages) + list(new_messages), add_generation_prompt, model, template_kwargs)
    if not after.startswith(before):
        raise _not_append_only(
            model,
            turn,
            "adding the turn's messages changes the rendering of the conversation so far",
            ("before", before),
            ("after", after),
            "The tokens the policy sampled would not be the ones trained on. Use a chat template that only appends "
            "(e.g. one that keeps earlier turns' reasoning instead of dropping their <think> blocks, and keeps every turn)",
        )
    sequence = tokenizer.decode(list(sequence_ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if not after.startswith(sequence):
        raise _not_append_only(
            model,
            turn,
            "the episode's tokens so far do not decode to a prefix of the template's rendering",
            ("sampled", sequence),
            ("rendered", after),
            "The template rewrites what the policy sampled (e.g. trims whitespace or drops a think block), or a turn "
            "ended with a token the template does not render, or an assistant message's content is not the decoded "
            "sampled text. Use a chat template that renders the assistant's content as sampled and only appends",
        )
    return _encode(tokenizer, after[len(sequence) :])


def _render(
    tokenizer, messages: list[dict], add_generation_prompt: bool, model: str, template_kwargs: dict[str, Any] | None
) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            f"model {model}: its tokenizer has no chat template, so chat turns cannot be rendered; "
            "set taskset.template (and build the turns' text yourself with episode.append_text), or use a model whose tokenizer has one."
        )
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **(template_kwargs or {})
    )


def _encode(tokenizer, text: str) -> list[int]:
    """`text`'s ids as they follow earlier ids: no BOS/EOS added, special token strings kept whole."""
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=False)["input_ids"])


def _not_append_only(
    model: str, turn: int, what: str, old: tuple[str, str], new: tuple[str, str], fix: str
) -> TemplateNotAppendOnly:
    """The refusal: model, turn, what changed, the first differing character with both texts around it, the fix."""
    n = min(len(old[1]), len(new[1]))
    at = next((i for i in range(n) if old[1][i] != new[1][i]), n)
    return TemplateNotAppendOnly(
        f"model {model}, turn {turn}: the chat template is not append-only: {what}; they differ at character {at} "
        f"({old[0]}: {_excerpt(old[1], at)}, {new[0]}: {_excerpt(new[1], at)}). {fix}, or build the turn's text "
        "yourself with episode.append_text."
    )


def _excerpt(text: str, at: int) -> str:
    start = max(0, at - _EXCERPT)
    return ("..." if start else "") + repr(text[start : at + _EXCERPT]) + ("..." if at + _EXCERPT < len(text) else "")
