"""A tiny Qwen2-architecture causal LM + character-level tokenizer, built locally (no hub).

Used by tests, benchmarks and the demo. Deterministic for a given seed: same seed, same bytes.
vLLM's CPU build refuses head_dim 16, so heads are 64 wide (hidden 128 = 2 heads x 64).

    rft make-tiny-model runs/models/tiny            # ~0.3M parameters
    python -m rl_engine.tiny_model DIR --hidden 512 --layers 4

`make_tiny_classifier` writes a sequence classifier of the same tokenizer (a reward model).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PAD, EOS, UNK = "<pad>", "<|endoftext|>", "<unk>"
SPECIALS = [PAD, EOS, UNK]


def build_tokenizer():
    """A byte-level tokenizer with no merges: one token per byte (= per character for ASCII).

    It is a BPE model in Qwen2's own format (byte-level pre-tokenizer and decoder, empty merge
    list), so `AutoTokenizer` (which picks Qwen2Tokenizer for this architecture, in transformers
    and in vLLM) rebuilds exactly this tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIALS + alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )


def make_tiny_model(
    out_dir: str | Path,
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 2,
    intermediate_size: int | None = None,
    num_heads: int | None = None,
    max_position_embeddings: int = 1024,
) -> Path:
    """Write a randomly initialised Qwen2ForCausalLM and its tokenizer to `out_dir` (HF layout)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if hidden_size % 64:
        raise ValueError(
            f"hidden_size {hidden_size} must be a multiple of 64 (head_dim 64; vLLM CPU refuses smaller heads)"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    heads = num_heads or hidden_size // 64
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=hidden_size // heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id})
    )
    return out


def make_tiny_classifier(out_dir: str | Path, seed: int = 0, num_labels: int = 1, hidden_size: int = 32) -> Path:
    """Write a randomly initialised Qwen2ForSequenceClassification (2 layers, `num_labels` scores)
    and the same tokenizer to `out_dir`: a reward model for tests and `bench.rewards --quick`
    (rl_engine.rewards.reward_model). Served by transformers only, so heads may be 16 wide."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        num_labels=num_labels,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    Qwen2ForSequenceClassification(config).to(torch.float32).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    a = ap.parse_args(argv)
    print(make_tiny_model(a.out_dir, seed=a.seed, hidden_size=a.hidden, num_layers=a.layers))


if __name__ == "__main__":
    main()
