"""Chat turns as token ids (rl_engine.rollout.chat): the episode's ids are the prompt, the ids as
sampled and the appended ids of each new part, and they equal the tokens of the template's
rendering; templates that rewrite earlier text are refused, naming the model and the turn.

The tiny byte-level tokenizer (with <|im_start|>/<|im_end|> added as special tokens) covers the
logic; SmolLM2-135M-Instruct's real tokenizer and ChatML template are used when the directory
runs/models/smollm2-135m is there (`rft fetch-model smollm2-135m runs/models/smollm2-135m`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rl_engine.errors import UserError
from rl_engine.rollout.chat import TemplateNotAppendOnly, chat_prompt_ids, chat_turn_ids
from rl_engine.tiny_model import build_tokenizer

SMOLLM2 = Path(__file__).resolve().parents[3] / "runs" / "models" / "smollm2-135m"
MODEL = "runs/models/tiny-chat"

# Qwen2.5 / SmolLM2 style ChatML.
CHATML = (
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
# ChatML with nothing between turns: the appended part begins with <|im_start|>.
CHATML_TIGHT = CHATML.replace("<|im_end|>\\n", "<|im_end|>")
# Qwen3 style: an assistant turn before the last user message loses its <think> block.
DROPS_THINK = (
    "{%- set ns = namespace(last_user=0) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- set c = m['content'] %}"
    "{%- if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in c %}{%- set c = c.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
LAST_THREE = CHATML.replace("in messages %}", "in messages[-3:] %}")
TURN_COUNTER = "{{ '<|im_start|>system\\nTurn ' + (messages | length) | string + '<|im_end|>\\n' }}" + CHATML
TRIMS = CHATML.replace("m['content']", "(m['content'] | trim)")


def _tokenizer(template: str | None = CHATML):
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = template
    return tok


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _full_ids(tok, messages: list[dict]) -> list[int]:
    """The tokens of the whole conversation rendered at once (what a trainer re-tokenising would see)."""
    return _ids(tok, tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def _sample(tok, text: str, end: bool = True) -> tuple[list[int], str]:
    """Ids as the policy might sample them (ending with <|im_end|> or, stopped by a stop string,
    without it) and the assistant content the template sees (their text, special tokens skipped)."""
    ids = _ids(tok, text) + ([tok.convert_tokens_to_ids("<|im_end|>")] if end else [])
    return ids, tok.decode(ids, skip_special_tokens=True)


def _episode(tok, turns: list[tuple[str, str, bool]], model: str = MODEL):
    """Play an episode: per turn, the policy samples (text, ended with <|im_end|>?) and the user replies."""
    messages = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "1+2?"}]
    ids = chat_prompt_ids(tok, messages, model)
    for turn, (sampled_text, ended, reply) in enumerate(turns, start=1):
        sampled, content = _sample(tok, sampled_text, ended)
        ids += sampled
        messages.append({"role": "assistant", "content": content})
        new = [{"role": "user", "content": reply}]
        delta = chat_turn_ids(tok, messages, ids, new, model, turn)
        ids += delta
        messages += new
    return ids, messages, delta


def test_prompt_ids_are_the_rendering_with_the_generation_prompt():
    tok = _tokenizer()
    messages = [{"role": "user", "content": "1+2?"}]
    assert chat_prompt_ids(tok, messages, MODEL) == _ids(
        tok, "<|im_start|>user\n1+2?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_appended_turns_give_the_full_renderings_tokens():
    tok = _tokenizer()
    ids, messages, delta = _episode(tok, [("3", True, "times 4?"), ("12", True, "minus 5?")])
    assert ids == _full_ids(tok, messages)
    assert (
        tok.decode(delta, skip_special_tokens=False)
        == "\n<|im_start|>user\nminus 5?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_turn_stopped_without_its_end_token_gets_it_in_the_appended_part():
    tok = _tokenizer()
    ids, messages, delta = _episode(tok, [("3 </answer>", False, "times 4?")])
    assert delta[0] == tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.decode(delta, skip_special_tokens=False).startswith("<|im_end|>\n<|im_start|>user\n")
    assert ids == _full_ids(tok, messages)


def test_special_token_text_in_the_appended_part_becomes_the_special_token():
    tok = _tokenizer(CHATML_TIGHT)
    tok.split_special_tokens = True  # even a tokenizer set to split them keeps the template's specials whole
    ids, messages, delta = _episode(tok, [("3", True, "times 4?")])
    start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert delta[0] == start and delta.count(start) == 2 and delta.count(end) == 1
    tok.split_special_tokens = False
    assert ids == _full_ids(tok, messages)


@pytest.mark.parametrize(
    "template, changed",
    [(DROPS_THINK, "<think>"), (LAST_THREE, "system"), (TURN_COUNTER, "Turn")],
    ids=["drops-earlier-think", "last-three-messages", "turn-counter-in-system"],
)
def test_a_template_that_rewrites_earlier_turns_is_refused_naming_model_and_turn(template, changed):
    tok = _tokenizer(template)
    model = "runs/models/qwen3-like"
    with pytest.raises(TemplateNotAppendOnly) as e:
        _episode(tok, [("3", True, "fine"), ("<think>\nadd 3\n</think>\n6", True, "next?")], model=model)
    msg = str(e.value)
    assert f"model {model}, turn " in msg and "not append-only" in msg
    assert changed in msg  # the excerpt shows what changed
    assert "append_text" in msg  # and the fix
    if template is DROPS_THINK:
        assert "turn 2" in msg  # turn 1's rendering is still append-only (no <think> yet)


def test_a_template_that_trims_the_sampled_content_is_refused():
    tok = _tokenizer(TRIMS)
    with pytest.raises(TemplateNotAppendOnly) as e:
        _episode(tok, [("3 \n", True, "times 4?")], model="my-model")
    msg = str(e.value)
    assert "model my-model, turn 1" in msg and "do not decode to a prefix" in msg
    assert "assistant\\n3 \\n<|im_end|>'" in msg and "assistant\\n3<|im_end|>" in msg  # sampled vs rendered excerpts


def test_a_turn_ended_by_a_token_the_template_does_not_render_is_refused():
    tok = _tokenizer()
    messages = [{"role": "user", "content": "1+2?"}, {"role": "assistant", "content": "3"}]
    ids = (
        chat_prompt_ids(tok, messages[:1], MODEL) + _ids(tok, "3") + [tok.eos_token_id]
    )  # <|endoftext|>, not <|im_end|>
    with pytest.raises(TemplateNotAppendOnly, match=r"turn 1: .*<\|endoftext\|>"):
        chat_turn_ids(tok, messages, ids, [{"role": "user", "content": "ok"}], MODEL, 1)


def test_no_chat_template_is_a_clear_user_error():
    tok = _tokenizer(None)
    messages = [{"role": "user", "content": "1+2?"}]
    for call in (
        lambda: chat_prompt_ids(tok, messages, MODEL),
        lambda: chat_turn_ids(tok, messages, [1, 2], messages, MODEL, 1),
    ):
        with pytest.raises(UserError, match="no chat template") as e:
            call()
        assert not isinstance(e.value, TemplateNotAppendOnly)
        assert MODEL in str(e.value) and "taskset.template" in str(e.value) and "append_text" in str(e.value)


@pytest.mark.skipif(
    not SMOLLM2.is_dir(), reason=f"no {SMOLLM2} (rft fetch-model smollm2-135m runs/models/smollm2-135m)"
)
def test_smollm2_chatml_turns_are_token_in_token_out():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(SMOLLM2))
    assert "<|im_start|>" in tok.chat_template  # its real ChatML template (adds a default system prompt)
    ids, messages, delta = _episode(
        tok, [("The answer is 3.", True, "And times 4?"), ("It is 12 </answer>", False, "Thanks!")]
    )
    assert ids == _full_ids(tok, messages)
    assert delta[0] == tok.convert_tokens_to_ids(
        "<|im_end|>"
    )  # the stopped turn's end token came with the appended part
    # The sampled ids are kept as sampled, even when not the canonical tokenisation of their text.
    messages = [{"role": "user", "content": "Say hi"}]
    prompt = chat_prompt_ids(tok, messages, "smollm2")
    sampled = [tok.convert_tokens_to_ids(c) for c in "hi"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert sampled[:2] != _ids(tok, "hi")
    messages.append({"role": "assistant", "content": tok.decode(sampled, skip_special_tokens=True)})
    delta = chat_turn_ids(tok, messages, prompt + sampled, [{"role": "user", "content": "again"}], "smollm2", 1)
    assert tok.decode(prompt + sampled + delta, skip_special_tokens=False) == tok.apply_chat_template(
        messages + [{"role": "user", "content": "again"}], tokenize=False, add_generation_prompt=True
    )
