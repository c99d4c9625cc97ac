"""``ftitan convert``: a run's checkpoint to an HF directory that ``transformers`` loads (same logits,
same token ids), and an HF directory to a run directory that ``ftitan generate --run`` reads.

Parity tolerance: max abs logit difference <= 1e-5 in float32 (same math, other summation orders).
"""

import torch
import transformers

import ftitan as ft
from ftitan import tree
from ftitan.__main__ import main
from ftitan.checkpoint import load_run
from ftitan.train.trainer import train

ATOL = 1e-5


def test_run_to_hf_loads_in_transformers_with_the_same_logits_and_tokens(tmp_path, tiny_run_cfg, capsys):
    train(tiny_run_cfg, progress=False)
    run, out = tmp_path / "run", tmp_path / "hf"
    assert main(["convert", "--run", str(run), "--hf", str(out)]) == 0
    _, model, params, tok, _ = load_run(run)
    hm = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    text = "def g(y):\n    return y + 1\n"
    ids = tok.encode(text)
    assert transformers.AutoTokenizer.from_pretrained(out)(text, add_special_tokens=False)["input_ids"] == ids
    tokens = torch.tensor([ids])
    with torch.no_grad():
        want = hm(input_ids=tokens).logits
    assert (model.apply(params, tokens)[0] - want).abs().max() <= ATOL
    # a second conversion onto the same directory is refused: nothing is overwritten
    assert main(["convert", "--run", str(run), "--hf", str(out)]) == 2
    assert "already holds a model" in capsys.readouterr().err


def test_hf_to_run_is_what_generate_run_reads(tmp_path, capsys):
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8, intermediate_size=40)  # fmt: skip
    hm = transformers.Qwen3ForCausalLM._from_config(config, attn_implementation="eager").eval()
    hm.save_pretrained(tmp_path / "hf")
    run = tmp_path / "run"
    assert main(["convert", "--hf", str(tmp_path / "hf"), "--run", str(run)]) == 0
    _cfg, model, params, tok, step = load_run(run)
    assert step == 0 and tok is None  # that HF directory has no tokenizer files
    _, want = ft.models.load_hf(tmp_path / "hf")
    assert all(torch.equal(a, b) for a, b in zip(tree.leaves(params), tree.leaves(want), strict=True))
    tokens = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model.apply(params, tokens)[0] - hm(input_ids=tokens).logits).abs().max() <= ATOL


def test_neither_directory_is_one_clear_line(tmp_path, capsys):
    assert main(["convert", "--run", str(tmp_path / "a"), "--hf", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "holds a config.json" in err
