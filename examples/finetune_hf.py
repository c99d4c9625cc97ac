"""Fine-tune a Hugging Face checkpoint on your own JSONL text, with its own tokenizer, and save it back.

    python examples/finetune_hf.py                      # builds a tiny random HF Llama to start from
    python examples/finetune_hf.py --hf path/to/model   # any saved Llama / Qwen3 / Qwen3-MoE / DeepSeek-V3

The same as the command line::

    ftitan train --init.hf MODEL --data.corpus my.jsonl --steps 100 --run-dir runs/ft
    ftitan convert --run runs/ft --hf runs/ft-hf

``--init.hf`` takes the architecture and weights from the checkpoint (each rank reads only its slices)
and the data its ``tokenizer.json`` (BOS/EOS from ``tokenizer_config.json``); the result is an HF
directory that ``transformers.AutoModelForCausalLM.from_pretrained`` loads.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

import ftitan as ft
from ftitan.checkpoint.convert import run_to_hf
from ftitan.config import parse_train_args
from ftitan.train.trainer import train


def make_hf_checkpoint(directory: Path, texts: list[str]) -> None:
    """A tiny random Llama with a BPE tokenizer (BOS <s>, EOS </s>), saved as transformers saves them."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(directory)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf", type=Path, help="an HF model directory (default: a tiny random one is made)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--workdir", type=Path, default=None, help="where files go (default: a temp directory)")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="ftitan-finetune-"))
    work.mkdir(parents=True, exist_ok=True)

    # your data: one {"text": ...} per line (here: standard-library modules)
    texts = [doc for _, doc in zip(range(300), ft.data.stdlib_corpus())]
    corpus = work / "data.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    hf_dir = args.hf or work / "base"
    if args.hf is None:
        make_hf_checkpoint(hf_dir, texts)

    cfg = parse_train_args([
        "--init.hf", str(hf_dir), "--data.corpus", str(corpus), "--run-dir", str(work / "run"),
        "--steps", str(args.steps), "--data.seq-len", "128", "--data.batch-size", "8", "--optim.lr", "1e-3",
        "--optim.warmup", "5", "--log-every", "5", "--eval-every", "0", "--ckpt-every", "0", "--compile", "False",
    ])  # fmt: skip
    out = train(cfg, progress=False)
    losses = [r["loss"] for r in out["records"] if "loss" in r]
    print(f"fine-tuned {type(cfg.model).__module__.rsplit('.', 1)[-1]} from {hf_dir}: "
          f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, held-out {out['eval_loss']:.3f}")

    saved = run_to_hf(work / "run", work / "finetuned")
    import transformers

    hm = transformers.AutoModelForCausalLM.from_pretrained(saved).eval()
    tok = transformers.AutoTokenizer.from_pretrained(saved)
    ids = torch.tensor([tok("def main():\n    return 0\n", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        diff = (hm(input_ids=ids).logits - out["model"].apply(out["params"], ids)[0]).abs().max().item()
    print(f"saved {saved}: transformers loads it, max |logit difference| vs ftitan {diff:.2e}")


if __name__ == "__main__":
    main()
