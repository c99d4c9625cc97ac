import pytest

from ftitan import config
from ftitan.models import llama


def test_transforms_compose_left_to_right():
    base = llama.Config.debug()
    out = config.compose(config.with_layers(2), config.with_vocab(4096), config.with_dim(128))(base)
    assert (out.n_layers, out.vocab_size, out.dim, out.ffn_dim) == (2, 4096, 128, 384)
    assert config.compose()(base) == base
    assert config.compose(config.with_layers(2), config.with_layers(3))(base).n_layers == 3


def test_max_seq_len_and_attn_impl():
    out = config.compose(config.with_max_seq_len(512), config.with_attn_impl("math"))(llama.Config.debug())
    assert (out.max_seq_len, out.attn_impl) == (512, "math")


@pytest.mark.parametrize(
    ("transform", "flag"),
    [
        (config.with_layers(0), "--model.n-layers"),
        (config.with_dim(100), "--model.dim"),
        (config.with_model_fields(n_kv_heads=3), "--model.n-heads"),
        (config.with_attn_impl("flash"), "--model.attn-impl"),
        (config.with_model_fields(norm_eps=0.0), "--model.norm-eps"),
    ],
)
def test_invalid_model_names_the_cli_flag(transform, flag):
    with pytest.raises(ValueError, match=flag):
        transform(llama.Config.debug())
