"""Recipes: plain functions ``() -> TrainConfig``, registered by name.

Recipes derive from each other by calling the parent and ``attrs.evolve``
(TorchTitan style), so a variant states only what differs:

>>> import attrs
>>> from ftitan.config import recipes
>>> def debug_long():  # decorate with @recipe("debug-long") to register it
...     return attrs.evolve(recipes.llama3_debug(), steps=2000)
>>> debug_long().steps, get_recipe("llama3-debug-muon").optim.name
(2000, 'muon')

The decorator stamps ``TrainConfig.recipe`` with the registered name, so a
derived recipe never carries its parent's name.
"""

from __future__ import annotations

import difflib
import functools
import types
from collections.abc import Callable, Mapping

import attrs

from ftitan.config.schema import (
    DataConfig,
    FlexShardConfig,
    MixedPrecisionConfig,
    OptimConfig,
    ParallelConfig,
    RLConfig,
    TrainConfig,
)
from ftitan.config.transforms import compose, with_dim, with_layers, with_max_seq_len, with_vocab
from ftitan.models import deepseek_v3, deepseek_v4, llama, muse_glimmer, qwen3, qwen3_5, qwen3_moe, qwen3_next

__all__ = [
    "RECIPES",
    "Recipe",
    "deepseek_v3_debug",
    "deepseek_v3_debug_ep",
    "deepseek_v3_debug_mtp",
    "deepseek_v4_debug",
    "get_recipe",
    "kimi_k2_7_debug",
    "kimi_k2_debug",
    "kimi_k2_debug_muon_fsdp",
    "llama3_1b",
    "llama3_8b",
    "llama3_debug",
    "llama3_debug_fsdp_tp",
    "llama3_debug_muon",
    "llama3_debug_muon_fsdp",
    "muse_glimmer_debug",
    "qwen3_5_debug",
    "qwen3_5_moe_debug",
    "qwen3_debug",
    "qwen3_moe_debug",
    "qwen3_next_debug",
    "recipe",
]

Recipe = Callable[[], TrainConfig]

_REGISTRY: dict[str, Recipe] = {}
RECIPES: Mapping[str, Recipe] = types.MappingProxyType(_REGISTRY)  # read-only view: name -> recipe


def recipe(name: str) -> Callable[[Recipe], Recipe]:
    """Register ``fn`` under ``name``; the returned function sets ``TrainConfig.recipe = name``."""

    def register(fn: Recipe) -> Recipe:
        if name in _REGISTRY:
            raise ValueError(f"recipe {name!r} is already registered; pick another name")

        @functools.wraps(fn)
        def named() -> TrainConfig:
            return attrs.evolve(fn(), recipe=name)

        _REGISTRY[name] = named
        return named

    return register


def get_recipe(name: str) -> TrainConfig:
    """Build the recipe registered as ``name``; unknown names raise ``ValueError`` listing the known ones."""
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"--recipe {name!r} is not a known recipe; {hint}known recipes: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]()


@recipe("llama3-debug")
def llama3_debug() -> TrainConfig:
    """Tiny Llama (D=256, L=4, V=2048) on stdlib source: ~4 min on 2 CPU cores, compiled.

    8 x 256 tokens per step at ~3,000 tokens/s (measured on a 2-core EPYC),
    plus about a minute of first-time compilation and 15 s of tokenization.
    """
    model = compose(with_layers(4), with_vocab(2048))(llama.Config.debug())
    return TrainConfig(
        recipe="llama3-debug",
        model=model,
        optim=OptimConfig(name="adamw", lr=3e-3, warmup=30, schedule="cosine"),
        data=DataConfig(corpus="stdlib", vocab_size=model.vocab_size, seq_len=256, batch_size=8),
        steps=250,
        eval_every=50,
        ckpt_every=100,
    )


@recipe("llama3-debug-muon")
def llama3_debug_muon() -> TrainConfig:
    """``llama3-debug`` with Muon on hidden matrices (AdamW on the rest)."""
    base = llama3_debug()
    return attrs.evolve(base, optim=attrs.evolve(base.optim, name="muon"))


@recipe("llama3-debug-muon-fsdp")
def llama3_debug_muon_fsdp() -> TrainConfig:
    """``llama3-debug-muon`` on 4 processes, FSDP only (dp_shard 4) on FlexShard: per-layer buckets gathered
    as int8 (blockwise, 128 values a scale), distributed Muon (each matrix orthogonalized by one rank), per
    head on the attention projections.

    ``torchrun --standalone --nproc-per-node 4 -m ftitan train --recipe llama3-debug-muon-fsdp``
    """
    base = llama3_debug_muon()
    # eager: 4 inductor compiles sharing 2 cores take longer than this run
    return attrs.evolve(base, parallel=ParallelConfig(dp_shard=4), compile=False,
                        optim=attrs.evolve(base.optim, muon_blocks="heads"),
                        flexshard=FlexShardConfig(quantize="int8", muon="distributed"))  # fmt: skip


@recipe("llama3-debug-fsdp-tp")
def llama3_debug_fsdp_tp() -> TrainConfig:
    """``llama3-debug`` on 4 processes: FSDP 2 x TP 2 with sequence parallelism.

    ``torchrun --standalone --nproc-per-node 4 -m ftitan train --recipe llama3-debug-fsdp-tp``
    """
    base = llama3_debug()
    # eager: 4 inductor compiles sharing 2 cores take longer than this run
    return attrs.evolve(base, parallel=ParallelConfig(dp_shard=2, tp=2), compile=False)


def _published(model: llama.Config, *, seq_len: int, batch_size: int) -> TrainConfig:
    """A config around a published flavor: its vocabulary, AdamW at a pretraining-scale lr, bf16 compute
    (fp32 masters and optimizer state)."""
    return TrainConfig(
        recipe="",
        model=model,
        mixed_precision=MixedPrecisionConfig(compute="bf16"),
        optim=OptimConfig(name="adamw", lr=3e-4, warmup=200, schedule="cosine"),
        data=DataConfig(corpus="stdlib", vocab_size=model.vocab_size, seq_len=seq_len, batch_size=batch_size),
        steps=2000,
        eval_every=200,
        ckpt_every=500,
    )


@recipe("llama3-1b")
def llama3_1b() -> TrainConfig:
    """Llama 3.2 1B (published flavor, V=128256, tied embeddings)."""
    return _published(llama.Config.llama3_2_1b(), seq_len=2048, batch_size=8)


@recipe("llama3-8b")
def llama3_8b() -> TrainConfig:
    """Llama 3.1 8B (published flavor, V=128256)."""
    return _published(llama.Config.llama3_1_8b(), seq_len=2048, batch_size=8)


def _debug_run(model: object) -> TrainConfig:
    """``llama3-debug``'s data, optimizer and schedule around another family's debug model."""
    return attrs.evolve(llama3_debug(), model=model)


@recipe("qwen3-debug")
def qwen3_debug() -> TrainConfig:
    """Tiny Qwen3 (QK-norm, GQA, tied embeddings; D=256, L=4, V=2048) on stdlib source."""
    return _debug_run(qwen3.Config.debug())


@recipe("qwen3-moe-debug")
def qwen3_moe_debug() -> TrainConfig:
    """Tiny Qwen3-MoE (8 experts, top-2, softmax router, balancing loss 1e-3) on stdlib source."""
    return _debug_run(qwen3_moe.Config.debug())


@recipe("qwen3.5-debug")
def qwen3_5_debug() -> TrainConfig:
    """Tiny dense Qwen3.5 (3 Gated DeltaNet layers and 1 gated full-attention layer, zero-centered norms, tied
    embeddings) on stdlib source."""
    return _debug_run(qwen3_5.debug())


@recipe("qwen3.5-moe-debug")
def qwen3_5_moe_debug() -> TrainConfig:
    """Tiny Qwen3.5-MoE: ``qwen3.5-debug``'s layers with 8 experts top 2 + a sigmoid-gated shared expert in each."""
    return _debug_run(qwen3_5.debug_moe())


@recipe("qwen3-next-debug")
def qwen3_next_debug() -> TrainConfig:
    """Tiny Qwen3-Next (fused q/k/v/z projections per key head; 8 experts top 2 + gated shared expert)."""
    return _debug_run(qwen3_next.Config.debug())


@recipe("deepseek-v3-debug")
def deepseek_v3_debug() -> TrainConfig:
    """Tiny DeepSeek-V3 (MLA, first layer dense, 8 experts top-2 in 2 groups, 1 shared expert,
    sigmoid router with the aux-loss-free balancing bias) on stdlib source."""
    return _debug_run(deepseek_v3.Config.debug())


@recipe("deepseek-v4-debug")
def deepseek_v4_debug() -> TrainConfig:
    """Tiny DeepSeek-V4 (sliding / CSA / HCA attention with sinks, 2 hyper-connection streams, the first
    block hash-routed, 8 sqrt-softplus experts top-2 with the balancing bias, the indexer trained by its
    KL loss) on stdlib source."""
    return _debug_run(deepseek_v4.Config.debug())


@recipe("muse-glimmer-debug")
def muse_glimmer_debug() -> TrainConfig:
    """Tiny Muse Glimmer text decoder (3 sliding-window layers of 64 keys and 1 global NoPE layer, sigmoid
    attention gate, centered pre/post-norms, normed embedding, soft-capped logits) on stdlib source."""
    return _debug_run(muse_glimmer.Config.debug())


@recipe("kimi-k2-debug")
def kimi_k2_debug() -> TrainConfig:
    """Kimi K2's routing at debug size: DeepSeek-V3 architecture with one expert group
    (no group limit), 16 experts top-4 + 1 shared, routed scale 2.827, one dense layer."""
    k2 = deepseek_v3.Config.kimi_k2()
    model = attrs.evolve(
        deepseek_v3.Config.debug(), n_experts=16, top_k=4, n_groups=k2.n_groups, topk_groups=k2.topk_groups,
        routed_scale=k2.routed_scale, n_shared_experts=k2.n_shared_experts, moe_ffn_dim=64,
    )  # fmt: skip
    return _debug_run(model)


@recipe("kimi-k2.7-debug")
def kimi_k2_7_debug() -> TrainConfig:
    """Kimi K2.7's text decoder at debug size: ``kimi-k2-debug``'s routing (no group limit, 1 shared expert,
    routed scale 2.827) with K2.5/K2.6/K2.7's norm epsilon 1e-5 and RoPE base 50000."""
    k27 = deepseek_v3.Config.kimi_k2_7()
    base = kimi_k2_debug()
    return attrs.evolve(base, model=attrs.evolve(base.model, norm_eps=k27.norm_eps, rope_theta=k27.rope_theta))


@recipe("deepseek-v3-debug-mtp")
def deepseek_v3_debug_mtp() -> TrainConfig:
    """``deepseek-v3-debug`` with one multi-token-prediction module trained beside it (loss weight 0.3,
    DeepSeek-V3's first-phase lambda); its drafts feed ``ftitan.infer.speculative``."""
    base = deepseek_v3_debug()
    return attrs.evolve(base, model=attrs.evolve(base.model, n_mtp_layers=1, mtp_loss_weight=0.3))


@recipe("deepseek-v3-debug-ep")
def deepseek_v3_debug_ep() -> TrainConfig:
    """``deepseek-v3-debug`` on 4 processes: expert parallel 2 x FSDP 2 (eager here: ``--compile True`` compiles
    it too, the expert all-to-all having static sizes, at a long cold compile on a CPU).

    ``torchrun --standalone --nproc-per-node 4 -m ftitan train --recipe deepseek-v3-debug-ep``
    """
    return attrs.evolve(deepseek_v3_debug(), parallel=ParallelConfig(ep=2, dp_shard=2), compile=False)


@recipe("kimi-k2-debug-muon-fsdp")
def kimi_k2_debug_muon_fsdp() -> TrainConfig:
    """Kimi K2's recipe at debug size: ``kimi-k2-debug`` trained with Muon (Moonlight's update scale) on 4
    processes, FSDP only, on FlexShard's block placement: each dp_shard rank stores whole heads of the MLA
    projections and whole experts, so per-head Muon on MLA and per-expert Muon run where the blocks are, with
    no communication; the other matrices are orthogonalized by one owner rank each.

    ``torchrun --standalone --nproc-per-node 4 -m ftitan train --recipe kimi-k2-debug-muon-fsdp``
    """
    base = kimi_k2_debug()
    return attrs.evolve(base, parallel=ParallelConfig(dp_shard=4), compile=False,
                        optim=attrs.evolve(base.optim, name="muon", muon_blocks="heads"),
                        flexshard=FlexShardConfig(placement="block", muon="distributed"))  # fmt: skip


@recipe("dpo-debug")
def dpo_debug() -> TrainConfig:
    """DPO on a synthetic preference set made locally (``task:format``: an answer in the house style,
    "The answer is 95.", preferred to "95, i think"), from scratch on a tiny Llama with its own BPE:
    ``rewards/accuracy`` reaches 1 within 10 steps. ``--data.preference task:arith`` (the right sum over a
    near miss) needs a model that can add. For a real run: ``--recipe sft --init.hf DIR --data.chat ""
    --data.preference FILE``."""
    model = compose(with_layers(2), with_vocab(512), with_dim(128, ffn_dim=384), with_max_seq_len(64))(
        llama.Config.debug())
    return TrainConfig(
        recipe="dpo-debug",
        model=model,
        optim=OptimConfig(name="adamw", lr=1e-3, warmup=5, schedule="cosine", weight_decay=0.0),
        data=DataConfig(preference="task:format", vocab_size=512, seq_len=32, batch_size=16),
        steps=60, eval_every=20, eval_batches=2, ckpt_every=60, log_every=5,
    )  # fmt: skip


@recipe("sft-debug")
def sft_debug() -> TrainConfig:
    """Chat SFT with no files at all: a tiny Llama with its own BPE learns a synthetic chat task made locally
    (``task:sort``: "Sort the digits: 7 2 9" -> "The answer is 2 7 9."), conversations packed into rows.
    Logs the exact match of greedy answers to 200 held-out questions at each evaluation: 0 untrained,
    the format within ~50 steps, >= 90% of answers right by the end (a minute on 2 CPU cores, compiled)."""
    model = compose(with_layers(2), with_vocab(300), with_dim(128, ffn_dim=384), with_max_seq_len(128))(
        llama.Config.debug())
    return TrainConfig(
        recipe="sft-debug",
        model=model,
        optim=OptimConfig(name="adamw", lr=3e-3, warmup=30, schedule="cosine", weight_decay=0.1),
        data=DataConfig(chat="task:sort", vocab_size=300, seq_len=128, batch_size=8),
        steps=200, eval_every=50, eval_batches=4, ckpt_every=200, log_every=10,
    )  # fmt: skip


@recipe("sft")
def sft() -> TrainConfig:
    """Chat SFT of a published checkpoint: ``ftitan train --recipe sft --init.hf DIR --data.chat FILE.jsonl``
    (add ``--lora.rank 16`` for LoRA). The model, tokenizer and chat template come from DIR; the loss is
    the mean over assistant tokens of packed conversations. AdamW at a fine-tuning lr, no weight decay,
    a short warmup, cosine to 10%."""
    base = sft_debug()  # without --init.hf: sft-debug's model and task, at a fine-tuning lr
    return attrs.evolve(
        base,
        model=with_max_seq_len(2048)(base.model),
        optim=OptimConfig(name="adamw", lr=2e-5, warmup=10, schedule="cosine", weight_decay=0.0),
        data=attrs.evolve(base.data, seq_len=512, batch_size=8),
        steps=200, eval_every=50, eval_batches=4, ckpt_every=100,
    )  # fmt: skip



@recipe("grpo-arith")
def grpo_arith() -> TrainConfig:
    """GRPO with no files at all (``ftitan rl``): sft-debug's tiny Llama first learns the format of a synthetic
    arithmetic task by a short SFT stage on its demonstrations (``RUN/sft``), then GRPO raises its reward:
    8 prompts x 8 samples a step, exact-match rewards, group-normalized advantages, DAPO's clip-higher and
    token-mean loss, truncated importance sampling for the generator/trainer mismatch."""
    model = sft_debug().model
    return TrainConfig(
        recipe="grpo-arith",
        model=model,
        optim=OptimConfig(name="adamw", lr=3e-4, warmup=5, schedule="constant", weight_decay=0.0),
        data=DataConfig(vocab_size=model.vocab_size, seq_len=64, batch_size=16),
        rl=RLConfig(env="sort", sft_steps=55, sft_lr=3e-3, group_size=8, prompts=8, max_new_tokens=16),
        steps=100, eval_every=25, ckpt_every=50, log_every=1,
    )  # fmt: skip


@recipe("grpo-tools")
def grpo_tools() -> TrainConfig:
    """Multi-turn tool use (``ftitan rl``, environment ``prices``): the policy looks a price up with
    ``<tool>lookup: pear</tool>``, multiplies with ``<tool>calculator: 7 * 3</tool>`` and answers; each tool
    result comes back as a ``tool`` turn that is never trained on. An SFT stage of 300 steps on solved
    episodes comes first (60 taught the syntax but not to copy the fruit's name: sampled reward ~0.01);
    its greedy held-out reward is 1.0 and its sampled reward ~0.3, which RL at lr 1e-4 holds over 40 steps."""
    base = grpo_arith()
    model = compose(with_vocab(512), with_max_seq_len(256))(base.model)  # the tool help makes prompts long
    return attrs.evolve(
        base, model=model,
        data=attrs.evolve(base.data, vocab_size=512, seq_len=256, batch_size=8),
        optim=attrs.evolve(base.optim, lr=1e-4),  # at 3e-4 the sampled reward drifted down (0.33 -> 0.13, 30 steps)
        rl=attrs.evolve(base.rl, env="prices", sft_steps=300, max_new_tokens=20, prompts=4),
    )  # fmt: skip


@recipe("grpo-moe")
def grpo_moe() -> TrainConfig:
    """``grpo-arith`` on a tiny Qwen3-MoE (8 experts, top-2), with GRPO's k3 KL to the frozen SFT policy
    (``--rl.kl-coef 0.05``): 100 steps with finite losses, the KL to the reference below
    ``--rl.kl-bound 0.5`` throughout (a step above it warns)."""
    base = grpo_arith()
    model = compose(with_layers(2), with_vocab(300), with_dim(128, ffn_dim=384), with_max_seq_len(128))(
        qwen3_moe.Config.debug())
    model = attrs.evolve(model, expert_dim=96)
    return attrs.evolve(base, model=model, steps=100, rl=attrs.evolve(base.rl, kl_coef=0.05, kl_bound=0.5))
