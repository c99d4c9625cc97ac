"""Reinforcement learning from verifiable rewards: GRPO / DAPO losses, environments, rollouts."""

from ftitan.rl.envs import (
    ENVS,
    EpisodeState,
    Prompt,
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
from ftitan.rl.rollout import Rollouts, rollout, rows_of

__all__ = [
    "ENVS",
    "EpisodeState",
    "Prompt",
    "Rollouts",
    "SingleTurnEnv",
    "ToolEnv",
    "episode_tokens",
    "rollout",
    "rows_of",
    "run_episode",
    "single_turn",
    "user_prompt",
    "group_advantages",
    "grpo_loss_fn",
    "keep_informative_groups",
    "overlong_penalty",
    "policy_loss",
    "token_logprobs_and_entropy",
]
