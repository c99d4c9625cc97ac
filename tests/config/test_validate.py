import math

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ftitan import config
from ftitan.config.schema import TrainConfig


def _base() -> TrainConfig:
    return config.get_recipe("llama3-debug")


def _with(cfg: TrainConfig, **dotted) -> TrainConfig:
    """Evolve by dotted names ("optim.lr"); model fields go through the transforms (which re-word errors)."""
    groups: dict[str, dict] = {}
    for key, value in dotted.items():
        head, _, tail = key.partition("__")
        if tail:
            groups.setdefault(head, {})[tail] = value
        else:
            groups.setdefault("", {})[head] = value
    changes = groups.pop("", {})
    for head, fields in groups.items():
        if head == "model":
            changes["model"] = config.with_model_fields(**fields)(cfg.model)
        else:
            changes[head] = attrs.evolve(getattr(cfg, head), **fields)
    return attrs.evolve(cfg, **changes)


CASES = [
    (dict(data__vocab_size=4096), "--model.vocab-size"),
    (dict(data__seq_len=4096), "--data.seq-len"),
    (dict(data__batch_size=16, accum_steps=3), "--data.batch-size"),
    (dict(accum_steps=0), "--accum-steps"),
    (dict(steps=0), "--steps"),
    (dict(optim__lr=0.0), "--optim.lr"),
    (dict(optim__lr=-1.0), "--optim.lr"),
    (dict(optim__lr=math.nan), "--optim.lr"),
    (dict(optim__warmup=301), "--optim.warmup"),
    (dict(optim__warmup=250), "--optim.warmup"),  # = --steps: the cosine decay needs a step after it
    (dict(optim__warmup=-1), "--optim.warmup"),
    (dict(optim__name="sgdd"), "--optim.name"),
    (dict(optim__schedule="linear"), "--optim.schedule"),
    (dict(optim__final_lr_fraction=2.0), "--optim.final-lr-fraction"),
    (dict(optim__weight_decay=-0.1), "--optim.weight-decay"),
    (dict(optim__b1=1.0), "--optim.b1"),
    (dict(optim__b2=-0.5), "--optim.b2"),
    (dict(optim__clip=-1.0), "--optim.clip"),
    (dict(eval_every=-1), "--eval-every"),
    (dict(ckpt_every=-1), "--ckpt-every"),
    (dict(log_every=-1), "--log-every"),
    (dict(eval_batches=0), "--eval-batches"),
    (dict(keep=0), "--keep"),
    (dict(gemm_library="mkl"), "--gemm-library"),
    (dict(data__corpus="/no/such/file.txt"), "--data.corpus"),
    (dict(data__corpus="README.md"), "--data.corpus"),
    (dict(data__vocab_size=256, model__vocab_size=256), "--data.vocab-size"),
    (dict(data__seq_len=0), "--data.seq-len"),
    (dict(data__batch_size=0), "--data.batch-size"),
    (dict(parallel__tp=2), "--parallel.*"),  # one process launched
    (dict(parallel__pp_schedule="zero-bubble"), "--parallel.pp-schedule"),
    (dict(parallel__pp_microbatches=-1), "--parallel.pp-microbatches"),
    (dict(parallel__backend="mpi"), "--parallel.backend"),
    (dict(flexshard__muon="allgather"), "--flexshard.muon"),
    (dict(flexshard__placement="owned"), "--flexshard.placement"),
    (dict(optim__name="muon", optim__muon_blocks="experts"), "--optim.muon-blocks"),
    (dict(optim__muon_blocks="heads"), "--optim.muon-blocks"),  # AdamW has no blocks
]


@pytest.mark.parametrize(("changes", "flag"), CASES, ids=[flag for _, flag in CASES])
def test_each_rule_names_its_flag(changes, flag):
    with pytest.raises(ValueError, match=flag.replace(".", r"\.")):
        config.validate(_with(_base(), **changes))


@pytest.mark.parametrize(
    ("world", "changes", "flag"),
    [
        (4, dict(parallel__dp_shard=4, data__batch_size=6), "--data.batch-size"),
        (4, dict(parallel__cp=4, data__seq_len=100), "--data.seq-len"),
        (2, dict(parallel__pp=2, data__batch_size=6, compile=False), "--parallel.pp-microbatches"),  # 6 rows, 4 micro
        (8, dict(parallel__pp=8, compile=False), "--parallel.pp=8"),  # 4 layers
        (2, dict(parallel__pp=2), "--compile"),  # the pipeline runs eagerly
    ],
)
def test_parallel_rules_under_torchrun_name_their_flag(monkeypatch, world, changes, flag):
    monkeypatch.setenv("WORLD_SIZE", str(world))  # what torchrun --nproc-per-node sets
    with pytest.raises(ValueError, match=flag.replace(".", r"\.")):
        config.validate(_with(_base(), **changes))
    config.validate(_with(_base(), parallel__dp_shard=world))  # the right degrees pass


def test_expert_parallel_compiles(monkeypatch):
    # the padded expert exchange has static all-to-all sizes: ep > 1 takes --compile (and regional)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for compile in (True, "regional"):
        config.validate(_with(_base(), parallel__ep=2, compile=compile))


def test_valid_variants_pass(tmp_path):
    for corpus in ("c.txt", "c.jsonl"):
        (tmp_path / corpus).write_text("hello")
        config.validate(_with(_base(), data__corpus=str(tmp_path / corpus)))
    config.validate(_with(_base(), accum_steps=4, eval_every=0, ckpt_every=0, log_every=0, optim__warmup=249))


def test_model_checks_surface_with_the_model_prefix():
    # a model that bypassed its own checks (object.__setattr__) is still caught, with the flag name
    cfg = _base()
    object.__setattr__(cfg.model, "dim", 100)
    with pytest.raises(ValueError, match=r"--model\.dim"):
        config.validate(cfg)


_small_ints = st.integers(min_value=-2, max_value=600)
_floats = st.one_of(st.floats(min_value=-1.0, max_value=2.0), st.sampled_from([0.0, math.nan, math.inf]))
_FIELDS = {
    "steps": _small_ints,
    "accum_steps": st.integers(-1, 5),
    "eval_every": _small_ints,
    "eval_batches": st.integers(-1, 4),
    "log_every": _small_ints,
    "ckpt_every": _small_ints,
    "keep": st.integers(-1, 4),
    "optim__name": st.sampled_from(["adamw", "muon", "sgd", ""]),
    "optim__schedule": st.sampled_from(["cosine", "wsd", "constant", "linear"]),
    "optim__lr": _floats,
    "optim__warmup": _small_ints,
    "optim__final_lr_fraction": _floats,
    "optim__weight_decay": _floats,
    "optim__b1": _floats,
    "optim__b2": _floats,
    "optim__clip": _floats,
    "data__corpus": st.sampled_from(["stdlib", "x.txt", "README.md", ""]),
    "data__vocab_size": st.integers(0, 3000),
    "data__seq_len": st.integers(-1, 3000),
    "data__batch_size": st.integers(-1, 33),
    "model__vocab_size": st.integers(-1, 3000),
    "model__dim": st.sampled_from([0, 64, 96, 100, 256]),
    "model__n_layers": st.integers(-1, 3),
    "model__n_heads": st.integers(-1, 9),
    "model__n_kv_heads": st.integers(-1, 9),
    "model__max_seq_len": st.integers(-1, 3000),
    "model__attn_impl": st.sampled_from(["sdpa", "math", "flash"]),
}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(sorted(_FIELDS)), st.none(), max_size=6).flatmap(
    lambda keys: st.fixed_dictionaries({k: _FIELDS[k] for k in keys})
))
def test_fuzz_validation_only_raises_value_errors_naming_a_flag(changes):
    try:
        config.validate(_with(_base(), **changes))
    except ValueError as e:
        assert str(e).startswith("--"), str(e)


def test_a_degree_below_one_names_its_flag():
    with pytest.raises(ValueError, match=r"^--parallel\.tp=0: must be an int >= 1"):
        config.validate(_with(_base(), parallel__tp=0))
