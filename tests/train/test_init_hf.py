"""``ftitan train --init.hf DIR``: the run starts from the HF checkpoint (its architecture, its weights):
the first step's loss equals ``transformers``' loss of the same model on the same batch.

Tolerance 1e-5 (float32; same math, other summation orders).
"""

import json

import pytest
import torch
import transformers

from ftitan.config import parse_train_args
from ftitan.data.pipeline import loader_state_like, prepare, train_batches
from ftitan.models import qwen3
from ftitan.train.trainer import train


@pytest.fixture()
def hf_dir(tmp_path):
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8, intermediate_size=40,
                                      max_position_embeddings=64)  # fmt: skip
    hm = transformers.Qwen3ForCausalLM._from_config(config, attn_implementation="eager").eval()
    hm.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf", hm


def test_first_step_loss_is_the_hf_models_loss(tmp_path, hf_dir):
    directory, hm = hf_dir
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n"}) + "\n" for i in range(200)))
    cfg = parse_train_args([
        "--init.hf", str(directory), "--run-dir", str(tmp_path / "run"), "--data.corpus", str(corpus),
        "--data.seq-len", "16", "--data.batch-size", "2", "--steps", "1", "--optim.warmup", "0", "--eval-batches", "1",
        "--log-every", "1", "--compile", "False", "--device", "cpu",
    ])  # fmt: skip
    assert isinstance(cfg.model, qwen3.Config) and cfg.model.dim == 32 and cfg.data.vocab_size == 300
    out = train(cfg, progress=False)
    batches = train_batches(prepare(cfg, tmp_path / "run"), cfg, loader_state_like(cfg), device=torch.device("cpu"))
    batch = next(batches)
    batches.close()
    row = torch.cat([batch["inputs"], batch["targets"][:, -1:]], dim=1)
    with torch.no_grad():
        want = hm(input_ids=row, labels=row).loss.item()
    assert abs(out["records"][0]["loss"] - want) <= 1e-5


def test_a_model_flag_that_changes_shapes_is_named(tmp_path, hf_dir):
    directory, _ = hf_dir
    cfg = parse_train_args(["--init.hf", str(directory), "--model.ffn-dim", "48", "--run-dir", str(tmp_path / "r"),
                            "--steps", "1", "--optim.warmup", "0", "--compile", "False", "--data.seq-len", "16"])  # fmt: skip
    with pytest.raises(ValueError, match=r"--init.hf=.*\(40, 32\).*in the checkpoint but \(48, 32\)"):
        train(cfg, progress=False)


def test_not_a_checkpoint_directory_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--init.hf=.*no config.json"):
        parse_train_args(["--init.hf", str(tmp_path)])
