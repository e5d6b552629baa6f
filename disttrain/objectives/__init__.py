"""Training objectives. Each owns its collator, its loss (with its metrics and eval record) and its
preparation before the first update, behind one interface (base.py):

    sft.py           supervised fine-tuning
    dpo.py           preference tuning: DPO, IPO, hinge, SimPO, ORPO, KTO
    base.py          the seams: Objective (collator, loss, prepare, steps) and Loss (what the loop calls)
    token_loss.py    LossEngine, the component every loss holds: lm_head -> cross-entropy a chunk at a time, no
                     full logits (or plain / TRL's fused head), the model family's transforms and MoE router
                     loss, the start-up self-check; TokenLoss, SFT's loss over it
    fused_head.py    training.loss_impl: trl -- TRL's fused LM head as the engine instead (for comparison)
    preference.py    the pair losses, their chunked gradient, the reference (precomputed / live / adapters off)
    kto.py           KTO on examples judged one by one: its loss, z (the KL estimate from mismatched examples)
    grpo.py          online RL: the objective, its step source (Rollouts: sample, score, train) and loss
    rollout.py       completions sampled from the current policy (one batched generate per rank), laid out as
                     training rows
    sampling.py      each completion's own seed: Gumbel-max over counter-based noise, the recipe's warpers only
    vllm_engine.py   rl.engine: vllm -- a vLLM server through TRL's client, the weight push, the IS correction
    rl_metrics.py    what online RL logs: rewards, lengths, KL, entropy, clip shares, the functions' log_metric
    rewards.py       reward functions (module:function, as TRL calls them), their checks, the advantages
    policy_loss.py   the GRPO-family losses on per-token log-probs (grpo, dr_grpo, dapo, bnpo, cispo; GSPO)
    reward_model.py  reward-model training: a score head, Bradley-Terry on preference pairs
    distill.py       knowledge distillation (GKD): the teacher's distributions, on the data's, the student's or the
                     teacher's completions; the generalised JSD a chunk of tokens at a time
"""

from __future__ import annotations


def objective_for(recipe):
    """The recipe's training.objective as an Objective (base.py)."""
    from disttrain.objectives.distill import Distill
    from disttrain.objectives.dpo import DPO
    from disttrain.objectives.grpo import GRPO
    from disttrain.objectives.reward_model import RewardModel
    from disttrain.objectives.sft import SFT

    return {"sft": SFT, "dpo": DPO, "grpo": GRPO, "reward": RewardModel,
            "distill": Distill}[recipe.training.objective](recipe)
