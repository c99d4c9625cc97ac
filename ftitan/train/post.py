"""What a run trains: its model (LoRA-wrapped under ``--lora.rank``), the leaves it differentiates, its
optimizer over them, and its objective (next-token loss, or DPO with the reference it needs). One place
that the trainer, the memory check, ``load_run`` and ``convert`` share.

Full fine-tuning and pretraining train every leaf. With ``--lora.rank R`` the model is
``ftitan.models.lora.lora(base, rank=R, ...)``: params ``{"base": ..., "lora": ...}``, of which only
``lora.**`` are differentiated and hold optimizer state (``make_train_step(..., trainable=)``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ftitan import optim
from ftitan.models import lora, registry
from ftitan.models.base import Model
from ftitan.optim.masking import subset

if TYPE_CHECKING:
    from ftitan.config.schema import LoRAConfig, TrainConfig

__all__ = ["base_model_of", "loss_of", "lora_alpha", "reference_of", "model_of", "optimizer_of", "trainable_of"]


def lora_alpha(c: LoRAConfig) -> float:
    """``--lora.alpha``, or ``2 * rank`` when it is 0."""
    return c.alpha if c.alpha else 2.0 * c.rank


def base_model_of(cfg: TrainConfig) -> Model:
    """The family's model of ``--model.*`` (what an HF checkpoint holds)."""
    return registry.model_for(cfg.model)


def model_of(cfg: TrainConfig) -> Model:
    """The run's model: the base, or with ``--lora.rank`` the base with LoRA adapters."""
    base = base_model_of(cfg)
    if not cfg.lora.rank:
        return base
    targets = tuple(t.strip() for t in cfg.lora.targets.split(",") if t.strip()) or None
    return lora.lora(base, rank=cfg.lora.rank, alpha=lora_alpha(cfg.lora), targets=targets)


def trainable_of(cfg: TrainConfig) -> str | None:
    """The glob of the leaves a run differentiates (``None``: all of them)."""
    return lora.TRAINABLE if cfg.lora.rank else None


def optimizer_of(cfg: TrainConfig, model: Model, shapes: Any, layout: Any = None) -> optim.Transform:
    """``--optim.*`` over the trained leaves (Muon routes by their shapes); a model's frozen leaves
    (DeepSeek-V3's routing bias) are left unchanged. Muon under a parallel ``layout``: FlexShard's
    distributed Newton-Schulz (``--flexshard.muon``); ``--optim.muon-blocks heads``: per head."""
    from ftitan.flexshard.mesh import head_blocks

    trainable = trainable_of(cfg)
    over = shapes if trainable is None else subset(trainable, shapes)
    blocks = head_blocks(model) if cfg.optim.muon_blocks == "heads" else None
    return optim.from_config(cfg.optim, cfg.steps, over, frozen=model.frozen, layout=layout, blocks=blocks,
                             muon=cfg.flexshard.muon)  # fmt: skip



def loss_of(cfg: TrainConfig, model: Model) -> Callable[[Any, Any], Any]:
    """``loss_fn(params, batch) -> (loss, aux)``: DPO (``--dpo.*``) for ``--data.preference``, else the
    mean next-token loss over the batch's target tokens (pretraining text, or SFT's assistant tokens)."""
    from ftitan.train.dpo import dpo_loss_fn
    from ftitan.train.losses import next_token_loss

    if not cfg.data.preference:
        return next_token_loss(model)
    d = cfg.dpo
    return dpo_loss_fn(model, beta=d.beta, loss_type=d.loss_type, label_smoothing=d.label_smoothing,
                       reference_free=d.reference_free)  # fmt: skip


def reference_of(cfg: TrainConfig, model: Model, params: Any,
                 initial: Callable[[], Any]) -> Callable[[Any], Any] | None:  # fmt: skip
    """DPO's ``batch -> batch`` adding the reference's log-probs (``ftitan.train.dpo.with_reference``), or
    ``None`` (no preference data, or ``--dpo.reference-free``). The reference is the run's starting model:
    under LoRA the frozen base itself (``params["base"]``: the adapters off), else a second copy of the
    starting weights (``initial()``, the same draw or checkpoint)."""
    from ftitan.train.dpo import with_reference

    if not cfg.data.preference or cfg.dpo.reference_free:
        return None
    ref_model, ref_params = (base_model_of(cfg), params["base"]) if cfg.lora.rank else (model, initial())
    return lambda batch: with_reference(ref_model, ref_params, batch)
