"""A tiny HF chat checkpoint made in the tests: a random Qwen3 with a ChatML byte-level BPE whose template
marks assistant text with ``{% generation %}``, and chat JSONL files for it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{% else %}{{ m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
WORDS = "red green blue one two three cat dog sun moon yes no what is the colour number animal".split()


def conversations(n: int, seed: int = 0) -> list[dict]:
    """``n`` short conversations of 1 or 2 exchanges, some with a system turn."""
    g = torch.Generator().manual_seed(seed)

    def words(k: int) -> str:
        return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (k,), generator=g))

    out = []
    for i in range(n):
        msgs = [{"role": "system", "content": "be brief"}] if i % 3 == 0 else []
        for _ in range(1 + i % 2):
            msgs += [{"role": "user", "content": words(2 + i % 3)}, {"role": "assistant", "content": words(1 + i % 3)}]
        out.append({"messages": msgs})
    return out


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _hf_config(family: str) -> transformers.PretrainedConfig:
    """A tiny config of ``family`` (vocab 400, dim 32, 2 layers, 64 positions)."""
    common = dict(vocab_size=400, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64, tie_word_embeddings=False)  # fmt: skip
    if family == "llama":
        return transformers.LlamaConfig(**common, num_key_value_heads=2, head_dim=8, intermediate_size=48)
    if family == "qwen3":
        return transformers.Qwen3Config(**common, num_key_value_heads=2, head_dim=8, intermediate_size=48)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, num_key_value_heads=2, head_dim=8, intermediate_size=40,
                                           moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                           norm_topk_prob=True, mlp_only_layers=[0])  # fmt: skip
    if family == "deepseek_v3":
        return transformers.DeepseekV3Config(**common, num_key_value_heads=4, intermediate_size=48,
                                             moe_intermediate_size=16, q_lora_rank=None, kv_lora_rank=16,
                                             qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4,
                                             num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                                             n_group=1, topk_group=1)  # fmt: skip
    raise ValueError(family)


def make_hf_chat_dir(out: Path, *, family: str = "qwen3", seed: int = 0) -> tuple[Path, transformers.PreTrainedModel]:
    """A random tiny ``family`` model (vocab 400, dim 32, 2 layers, 64 positions) with its tokenizer and template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "<|im_start|>", "<|im_end|>"],
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator([" ".join(WORDS)] * 5 + [w for w in WORDS] * 5 + ["user assistant system be brief"] * 5,
                            trainer=trainer)  # fmt: skip
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(out)
    torch.manual_seed(seed)
    config = _hf_config(family)
    cls = transformers.AutoModelForCausalLM.from_config(config).__class__
    hm = cls._from_config(config, attn_implementation="eager").eval()
    hm.save_pretrained(out)
    return out, hm
