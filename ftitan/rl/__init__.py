"""Reinforcement learning from verifiable rewards: GRPO / DAPO losses, environments, rollouts."""

from ftitan.config.transforms import batch_invariant
from ftitan.rl.asynchronous import AsyncRollouts, Ledger, ProcessRollouts
from ftitan.rl.envs import (
    ENVS,
    EpisodeState,
    Prompt,
    demonstrations,
    SingleTurnEnv,
    ToolEnv,
    episode_tokens,
    run_episode,
    single_turn,
    user_prompt,
)
from ftitan.rl.losses import (
    group_advantages,
    grpo_loss_fn,
    keep_informative_groups,
    overlong_penalty,
    policy_loss,
    token_logprobs_and_entropy,
)
from ftitan.rl.loop import collect, rl_train
from ftitan.rl.rollout import Rollouts, episode_rollout, rollout, rows_of, sequence_rows, vllm_generate_fn

__all__ = [
    "AsyncRollouts",
    "ENVS",
    "EpisodeState",
    "Ledger",
    "ProcessRollouts",
    "Prompt",
    "Rollouts",
    "SingleTurnEnv",
    "ToolEnv",
    "batch_invariant",
    "collect",
    "demonstrations",
    "episode_rollout",
    "episode_tokens",
    "group_advantages",
    "grpo_loss_fn",
    "keep_informative_groups",
    "overlong_penalty",
    "policy_loss",
    "rl_train",
    "rollout",
    "rows_of",
    "run_episode",
    "sequence_rows",
    "single_turn",
    "token_logprobs_and_entropy",
    "user_prompt",
    "vllm_generate_fn",
]
