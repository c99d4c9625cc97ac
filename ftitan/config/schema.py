"""The run configuration: frozen attrs classes of Python scalars (tyro-readable).

A run is one ``TrainConfig``, built by a recipe (``ftitan.config.recipes``)
and adjusted by dotted CLI overrides (``--optim.lr 1e-3``).
"""

from __future__ import annotations

from typing import Annotated, Literal

import attrs
import tyro

from ftitan.config.transforms import with_float8, with_kernels, with_remat
from ftitan.kernels.op import KERNELS
from ftitan.models import deepseek_v3, deepseek_v4, llama, muse_glimmer, qwen3, qwen3_moe, qwen3_next
from ftitan.parallel.dims import ParallelDims

__all__ = ["CheckpointConfig", "DPOConfig", "DataConfig", "FlexShardConfig", "InitConfig", "LoRAConfig", "MixedPrecisionConfig",
           "ModelConfig", "OptimConfig", "ParallelConfig", "RLConfig", "TrainConfig"]  # fmt: skip

# every trainable family's config; a recipe picks one and its fields become --model.* flags
# (named for tyro, whose default names would collide: every family's class is called Config)
ModelConfig = (
    Annotated[llama.Config, tyro.conf.subcommand("llama")]
    | Annotated[qwen3.Config, tyro.conf.subcommand("qwen3")]
    | Annotated[qwen3_moe.Config, tyro.conf.subcommand("qwen3_moe")]
    | Annotated[deepseek_v3.Config, tyro.conf.subcommand("deepseek_v3")]
    | Annotated[muse_glimmer.Config, tyro.conf.subcommand("muse_glimmer")]
    | Annotated[deepseek_v4.Config, tyro.conf.subcommand("deepseek_v4")]
    | Annotated[qwen3_next.Config, tyro.conf.subcommand("qwen3_next")]
)


@attrs.frozen(kw_only=True)
class OptimConfig:
    """Optimizer and learning-rate schedule."""

    name: str = "adamw"  # "adamw", or "muon" (Muon on hidden matrices + AdamW on the rest)
    lr: float = 3e-3  # peak learning rate
    warmup: int = 50  # linear warmup steps (from 0)
    schedule: str = "cosine"  # "cosine", "wsd" (warmup-stable-decay) or "constant" (after warmup)
    final_lr_fraction: float = 0.1  # lr at the end of the schedule, as a fraction of lr
    weight_decay: float = 0.1  # decoupled weight decay
    b1: float = 0.9  # Adam beta1
    b2: float = 0.95  # Adam beta2
    clip: float = 1.0  # global-norm gradient clipping (0 disables it)
    nonfinite: str = "skip"  # NaN/inf gradients: "skip" the update, "stop" the run, or "off" (apply them)
    max_nonfinite: int = 3  # under "skip": this many non-finite steps in a row stop the run
    muon_blocks: str = ""  # --optim.name muon: "heads" orthogonalizes attention projections per head (each head's rows of q/k/v, columns of o; MLA's up-projections); "": whole matrices (expert stacks are per expert either way)


@attrs.frozen(kw_only=True)
class DataConfig:
    """Where tokens come from and how they are batched."""

    corpus: str = "stdlib"  # "stdlib" (the interpreter's standard library source), or .parquet / .jsonl / .txt files, a directory or a glob (streamed)
    jsonl_field: str = "text"  # field holding the document text in .jsonl / .parquet shards
    vocab_size: int = 2048  # byte-level BPE vocabulary trained on the corpus (cached in the run dir)
    tokenizer: str = ""  # an HF tokenizer directory (tokenizer.json) to use instead of training a BPE
    seq_len: int = 256  # tokens per training row
    batch_size: int = 16  # rows per optimizer step
    chat: str = ""  # SFT: a .jsonl of conversations ({"messages": [...]} or {"prompt", "completion"}), or "task:NAME" (a synthetic task made locally, ftitan.data.tasks); trains on assistant tokens, packed rows
    preference: str = ""  # DPO: a .jsonl of {"prompt", "chosen", "rejected"} (or chosen/rejected conversations), or "task:NAME"
    truncate: bool = False  # SFT/DPO: cut a conversation longer than seq_len + 1 tokens (counted: data.truncated) instead of refusing it
    task_eval_items: int = 200  # --data.chat task:NAME: held-out items whose greedy answers are scored (exact match) at each evaluation


@attrs.frozen(kw_only=True)
class ParallelConfig:
    """Parallel degrees (their product is the number of processes: torchrun --nproc-per-node N)."""

    dp_replicate: int = 1  # data parallel, params replicated (DDP)
    dp_shard: int = 1  # data parallel, params sharded and gathered per layer (FSDP)
    ep: int = 1  # expert parallel: routed experts split across ranks (also splits the batch)
    cp: int = 1  # context parallel: the sequence split across ranks (head-tail chunks)
    tp: int = 1  # tensor parallel: heads, MLP width and vocab split across ranks
    pp: int = 1  # pipeline parallel: layers split into stages
    sequence_parallel: bool = True  # under tp, norms run on 1/tp of the tokens (Megatron-SP)
    pp_schedule: str = "1f1b"  # pipeline schedule: "1f1b" or "gpipe"
    pp_microbatches: int = 0  # micro-batches per step under pp (0: 2 * pp)
    backend: str = "auto"  # torch.distributed backend: "auto" (nccl on CUDA, gloo on CPU), "gloo" or "nccl"
    timeout_s: float = 60.0  # seconds a rank waits for its peers (joining, each collective) before failing

    def dims(self) -> ParallelDims:
        """The degrees as ``ftitan.parallel.ParallelDims`` (which checks each is an int >= 1)."""
        return ParallelDims(dp_replicate=self.dp_replicate, dp_shard=self.dp_shard, ep=self.ep, cp=self.cp,
                            tp=self.tp, pp=self.pp)  # fmt: skip

    @property
    def world_size(self) -> int:
        return self.dims().world_size


@attrs.frozen(kw_only=True)
class FlexShardConfig:
    """FlexShard, the data-parallel sharding behind --parallel.dp-shard (docs/flexshard.md)."""

    buckets: str = "per_layer"  # "per_layer": one all-gather / reduce-scatter per layer's dp_shard leaves; "per_leaf": one per leaf
    quantize: str = ""  # "int8" / "fp8": those all-gathers send blockwise-quantized params (128 values a float32 scale); "": the compute dtype
    muon: str = "distributed"  # --optim.name muon under dp_shard / tp: "distributed" (each matrix orthogonalized by one owner rank, or per block where each rank holds whole blocks) or "gather" (every rank gathers and orthogonalizes every matrix: FSDP-only Muon)
    placement: str = "shard"  # "shard": dp_shard splits each weight's model dim (rows of embed); "block": whole heads (when tp is 1) and whole experts (when ep is 1) per dp_shard rank, so per-head / per-expert Muon needs no communication


@attrs.frozen(kw_only=True)
class MixedPrecisionConfig:
    """Dtypes of the mixed-precision policy (FSDP2's vocabulary): "fp32", "bf16" or "fp16"."""

    param: str = "fp32"  # master params and optimizer state
    compute: str = "fp32"  # forward and backward (params cast inside the step; FSDP gathers in it)
    reduce: str = "fp32"  # data-parallel gradient reduction


@attrs.frozen(kw_only=True)
class InitConfig:
    """Where the initial params come from."""

    hf: str = ""  # an HF checkpoint directory to start from ("" : random init from --seed)


@attrs.frozen(kw_only=True)
class LoRAConfig:
    """LoRA adapters (Hu et al. 2021): train low-rank updates of the projections, the base frozen."""

    rank: int = 0  # adapter rank (0: full fine-tuning, every weight trained)
    alpha: float = 0.0  # the update is scaled by alpha / rank (0: alpha = 2 * rank)
    targets: str = ""  # comma-separated globs of the adapted weights ("": the family's attention and MLP projections)


@attrs.frozen(kw_only=True)
class DPOConfig:
    """Direct preference optimization (Rafailov et al. 2023), for --data.preference."""

    beta: float = 0.1  # strength of the KL anchor to the reference model
    loss_type: str = "sigmoid"  # "sigmoid" (DPO) or "ipo" (Azar et al. 2023)
    label_smoothing: float = 0.0  # conservative DPO: the share of preference labels assumed flipped (sigmoid only)
    reference_free: bool = False  # no reference model: its log-probs taken as 0


@attrs.frozen(kw_only=True)
class RLConfig:
    """Reinforcement learning from verifiable rewards (``ftitan rl``): GRPO / DAPO on an environment."""

    env: str = ""  # the environment (ftitan.rl.ENVS: add, sort, reverse, countdown, prices); "": not an RL run
    sft_steps: int = 0  # a short SFT stage on the environment's demonstrations first (in RUN_DIR/sft), then RL from it
    sft_lr: float = 3e-3  # the SFT stage's peak learning rate (AdamW, warmup, cosine)
    init_run: str = ""  # start from another run directory's newest checkpoint (its model, tokenizer and chat template)
    group_size: int = 8  # samples per prompt (G)
    prompts: int = 8  # prompts per step (P): a step trains on P * G samples
    max_new_tokens: int = 24  # tokens a sample (a turn, in a tool episode) may generate
    clip_low: float = 0.2  # the ratio's lower clip: 1 - clip_low
    clip_high: float = 0.28  # the ratio's upper clip: 1 + clip_high (DAPO clip-higher; PPO: 0.2)
    loss_agg: str = "token-mean"  # "token-mean" (DAPO) or "seq-mean-token-mean" (GRPO)
    advantage_scale: str = "std"  # "std" (GRPO: (r - mean) / std per group) or "none" (Dr. GRPO: r - mean)
    kl_coef: float = 0.0  # k3 KL to the frozen initial policy (GRPO's beta; 0: no reference kept)
    tis_cap: float = 2.0  # truncated importance sampling for the generator/trainer mismatch (0: off; unused in batch-invariant mode)
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal and sample more prompts to refill
    max_refills: int = 4  # dynamic sampling: extra generation rounds a step may take to fill its prompts
    overlong_cache: int = 0  # DAPO soft overlong penalty over the last this many of max_new_tokens (0: off)
    max_offpolicy_steps: int = 0  # 0: synchronous, on-policy; k >= 1: a generator thread samples ahead, rollouts up to k steps stale are trained on
    worker: str = "thread"  # where the async generator runs: "thread" (in this process) or "process" (a spawned one with its own copy of the policy and, under --rl.generator vllm, its own engine: a cluster's layout)
    generator: str = "native"  # "native" (ftitan.infer.generate) or "vllm" (the in-process vLLM engine)
    compile_generator: str = ""  # the native generator's decode steps under torch.compile: "inductor", or a backend name such as "aot_eager" ("": eager)
    batch_invariant: bool = False  # the model in batch-invariant mode: the generator's log-probs equal the trainer's bit for bit
    eval_prompts: int = 100  # held-out prompts answered greedily at each evaluation (eval.reward)
    kl_bound: float = 0.0  # the recipe's promise: the KL to the reference stays below this (0: none); a run above it warns


def _valid_remat(policy: str) -> bool:
    from ftitan.train.remat import parse_policy

    try:
        parse_policy(policy)
    except ValueError:
        return False
    return True


@attrs.frozen(kw_only=True)
class CheckpointConfig:
    """How checkpoints are written (how often and how many: --ckpt-every, --keep)."""

    backend: str = "torch-checkpointing"  # "torch-checkpointing" (async: shared-memory staging, writer subprocess), "dcp" (async: torch.distributed.checkpoint's safetensors writer) or "sync"
    commit_timeout: float = 600.0  # seconds rank 0 waits for every rank's files before it gives a save up
    subprocess_min_mib: float = 64.0  # torch-checkpointing's writer process starts with the first save of this many MiB on a rank; smaller saves are written from a thread (0: always the process)


@attrs.frozen(kw_only=True)
class TrainConfig:
    """One training run."""

    recipe: str  # the recipe this config came from
    model: ModelConfig  # model architecture (vocab_size must equal data.vocab_size)
    optim: OptimConfig = OptimConfig()
    data: DataConfig = DataConfig()
    parallel: ParallelConfig = ParallelConfig()
    flexshard: FlexShardConfig = FlexShardConfig()
    mixed_precision: MixedPrecisionConfig = MixedPrecisionConfig()
    init: InitConfig = InitConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    lora: LoRAConfig = LoRAConfig()
    dpo: DPOConfig = DPOConfig()
    rl: RLConfig = RLConfig()
    device: str = "auto"  # "auto" (CUDA when available), "cpu" or "cuda" (under torchrun: cuda:LOCAL_RANK)
    steps: int = 400  # optimizer steps in total
    accum_steps: int = 1  # micro-batches per step (batch_size must divide by it)
    eval_every: int = 50  # steps between held-out evaluations (0: only at the end)
    eval_batches: int = 8  # held-out batches per evaluation
    log_every: int = 10  # steps between metric records (0: only at the end)
    ckpt_every: int = 100  # steps between checkpoints (0: only at the end)
    keep: int = 3  # checkpoints kept (the newest K)
    compile: bool | Literal["regional"] = True  # torch.compile the train step (fullgraph); "regional": each block once (docs/compile-and-memory.md)
    remat: str = ""  # activation rematerialization of every block: "none", "full", "save-matmuls", "regions:attn", "budget:F" ("": --model.remat's)
    kernels: str = ""  # "triton": the model's kernels by ftitan.kernels (Triton on CUDA; references and oneDNN or MKL GEMMs on the CPU: --gemm-library; docs/kernels.md), "torch": plain ops ("": --model.kernels's)
    float8: str = ""  # "tensorwise" / "rowwise": the blocks' projections in float8 by that torchao recipe (docs/gpus-and-precision.md; "": --model.float8's)
    gemm_library: str = "auto"  # CPU runs with --kernels triton: the linear layers' and attention's fp32 GEMMs in the fastest of MKL ("aten"), oneDNN's inner product ("onednn") and oneDNN's matmul ("onednn-matmul", where float32) per shape ("auto", probed once per machine), or all in one (ftitan.kernels.onednn; docs/kernels.md)
    malloc_retain: bool = True  # CPU runs: glibc keeps the memory a step frees for the next step instead of returning it to the OS (ft.train.retain_freed_memory: the CPU benchmark step alone in a process ran ~7% faster); False: glibc's defaults
    deterministic: bool = True  # torch.use_deterministic_algorithms during the run: bit-identical reruns, compiled too (inductor's CPU scatter-adds otherwise vary in the last bits)
    seed: int = 0  # seeds init and data order
    run_dir: str = "runs/{recipe}"  # where tokenizer, metrics, checkpoints and loss.png go

    def __attrs_post_init__(self) -> None:
        # --kernels sets the model config's field, the one the model reads (config.with_kernels); an
        # unknown name is left for validate to refuse, naming the flag
        if self.kernels in KERNELS and self.model.kernels != self.kernels:
            object.__setattr__(self, "model", with_kernels(self.kernels)(self.model))
        # --float8 likewise (a recipe the model config lacks or refuses is left for validate, naming the flag)
        if self.float8 and getattr(self.model, "float8", self.float8) != self.float8:
            try:
                object.__setattr__(self, "model", with_float8(self.float8)(self.model))
            except ValueError:
                pass
        # --remat likewise sets the model config's remat field (an invalid policy is left for validate)
        if self.remat and self.remat != getattr(self.model, "remat", self.remat) and _valid_remat(self.remat):
            object.__setattr__(self, "model", with_remat(self.remat)(self.model))
