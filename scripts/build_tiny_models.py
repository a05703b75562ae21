#!/usr/bin/env python3
"""Build a tiny random model from scratch, offline (run with the vLLM venv's python).

    build_tiny_models.py chat OUT_DIR
    build_tiny_models.py gpt-oss OUT_DIR --vocab-dir DIR_WITH_o200k_base.tiktoken

``chat``: a Llama (hidden 64, head_dim 32, 2 layers) with a byte-level BPE
tokenizer trained here on a few paragraphs, and a Jinja chat template
(system/user/assistant, add_generation_prompt). Its end-of-turn token is
suppressed by the weights (see ``_suppress``), so a random generation runs to
its token limit unless something else (a grammar) forces the end.

``gpt-oss``: a ``GptOssForCausalLM`` (hidden 64, 2 layers, 4 experts) whose
tokenizer is o200k with the harmony special tokens at harmony's ids
(transformers' tiktoken converter), so the ids the router renders with
openai-harmony mean the same thing to vLLM. 201,088 vocabulary rows x 64.

Called by ``scripts/prepare_vllm_cpu.py``; seeded, so two builds give the same weights.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SEED = 1234

TEXT = """\
The router keeps the conversation and the worker keeps nothing. A request comes in, the router finds the
history, renders a prompt and streams the answer back as events. Workers are started by the router, watched,
and restarted when they die. Small models are enough to test the wire: the words do not need to make sense.
Hello! How are you today? I am fine, thank you. What is the weather in Paris? It is sunny and warm.
{"answer": "yes", "count": 3, "ok": true, "items": [1, 2, 3], "name": "tiny"}
def add(a, b):
    return a + b
Numbers 0 1 2 3 4 5 6 7 8 9 10 42 100 2024. Letters a b c d e f g h i j k l m n o p q r s t u v w x y z.
"""

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set content = message['content'] %}"
    "{% else %}{% set content = message['content'] | map(attribute='text') | join('') %}{% endif %}"
    "<|{{ message['role'] }}|>{{ content }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CHAT_SPECIALS = ["<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|developer|>", "<|tool|>"]


def _seed() -> None:
    import random

    import torch

    random.seed(SEED)
    torch.manual_seed(SEED)


def _suppress(model, token_ids: list[int], strength: float = 1.0) -> None:
    """Make ``token_ids`` (nearly) never sampled, whatever the context.

    Every embedding row gets a large constant in dimension 0, so after the final
    RMSNorm that dimension dominates the hidden state (~sqrt(hidden) times the norm
    weight, the layers' random contributions are small). The lm_head rows of the
    suppressed tokens get ``-strength`` there and every other row 0: their logits
    sit ~8*strength below the rest. Under a grammar that allows only them, they are
    still chosen (masking leaves nothing else).
    """
    import torch

    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[:, 0] = 1.0
        head = model.get_output_embeddings().weight
        head[:, 0] = 0.0
        for tid in token_ids:
            head[tid, 0] = -strength


def build_chat(out: Path) -> None:
    import torch
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    _seed()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=CHAT_SPECIALS, min_frequency=1,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|end|>", pad_token="<|pad|>",
                                   additional_special_tokens=CHAT_SPECIALS[3:])
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 4096
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)

    vocab = len(fast)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id, torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    _suppress(model, [fast.eos_token_id])
    model.save_pretrained(out, safe_serialization=True)
    model.generation_config.eos_token_id = fast.eos_token_id
    model.generation_config.save_pretrained(out)
    # A round trip through the template, so a broken template fails here and not in vLLM.
    ids = fast.apply_chat_template([{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}],
                                   add_generation_prompt=True, tokenize=True)
    print(json.dumps({"model": str(out), "vocab": vocab, "params": sum(p.numel() for p in model.parameters()),
                      "prompt_example": fast.decode(ids)}))


# openai-harmony's o200k_harmony: o200k_base's 199,998 ranks, then these specials at their ids, then
# <|reserved_N|> up to 201,087 (vocabulary 201,088, as in gpt-oss's config).
HARMONY_SPECIALS = {
    199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>", 200003: "<|constrain|>",
    200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>", 200012: "<|call|>",
    200018: "<|endofprompt|>",
}
OSS_VOCAB = 201088
O200K_PATTERN = "|".join([  # one alternative a line, as tiktoken writes it
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])


def build_gpt_oss(out: Path, vocab_dir: Path) -> None:
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM, PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    _seed()
    vocab_file = vocab_dir / "o200k_base.tiktoken"
    with open(vocab_file, "rb") as f:
        base = sum(1 for _ in f)
    specials = [HARMONY_SPECIALS.get(i, f"<|reserved_{i}|>") for i in range(base, OSS_VOCAB)]
    # transformers 5 names the list extra_special_tokens, 4.x additional_special_tokens.
    converted = TikTokenConverter(vocab_file=str(vocab_file), pattern=O200K_PATTERN, extra_special_tokens=specials,
                                  additional_special_tokens=specials).converted()
    fast = PreTrainedTokenizerFast(tokenizer_object=converted, bos_token="<|startoftext|>", eos_token="<|return|>",
                                   pad_token="<|endoftext|>")
    fast.model_max_length = 512
    for tid, text in HARMONY_SPECIALS.items():
        got = fast.convert_tokens_to_ids(text)
        if got != tid:
            raise SystemExit(f"tokenizer: {text} has id {got}, harmony says {tid}")
    if len(fast) != OSS_VOCAB:
        raise SystemExit(f"tokenizer has {len(fast)} tokens, expected {OSS_VOCAB}")
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)

    config = GptOssConfig(
        vocab_size=OSS_VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=128,
        max_position_embeddings=4096, rope_theta=150000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        layer_types=["sliding_attention", "full_attention"],
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                      "original_max_position_embeddings": 4096},
        bos_token_id=199998, eos_token_id=200002, pad_token_id=199999, torch_dtype="float32",
    )
    model = GptOssForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    model.generation_config.eos_token_id = [200002, 199999, 200012]
    model.generation_config.save_pretrained(out)
    print(json.dumps({"model": str(out), "vocab": len(fast), "params": sum(p.numel() for p in model.parameters())}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=["chat", "gpt-oss"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--vocab-dir", type=Path)
    args = parser.parse_args()
    if args.kind == "chat":
        build_chat(args.out)
    else:
        if args.vocab_dir is None:
            sys.exit("--vocab-dir is required for gpt-oss")
        build_gpt_oss(args.out, args.vocab_dir)


if __name__ == "__main__":
    main()
