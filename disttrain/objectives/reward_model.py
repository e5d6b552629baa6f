"""Reward-model training (training.objective: reward): the model with transformers' one-label
sequence-classification head (a new linear layer reading each sequence's last token), trained on the preference
pairs DPO reads, so that the chosen response scores above the rejected one (Bradley-Terry), as TRL's RewardTrainer
computes it (tests/test_reward_model.py runs TRL's own compute_loss on the same model and batch):

    loss per pair = -log sigmoid(r_chosen - r_rejected) [+ center_rewards_coefficient x (r_chosen + r_rejected)^2]

A micro-batch holds its pairs side by side (chosen rows, then rejected: data/preference.py's collator), so `units`
are pairs and the loop's normalisation makes the step's loss the mean over every pair on every rank. Padding-free
(data.packing), several sequences share a row: transformers' head would read each row's last token, so the score
head's per-token output is taken from its forward and read where transformers reads a padded row, at each
sequence's last token that is not the pad token. The final
model exports as a plain sequence-classification checkpoint (or its adapter, the score head saved in full), which
transformers' AutoModelForSequenceClassification loads and online RL uses as a reward (rl.rewards[].model).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from disttrain.data.collation import SEQUENCE_COUNT, SEQUENCE_INDEX, flattens_packed_rows
from disttrain.data.preference import PAIR_INDEX, PairCollator
from disttrain.objectives.preference import pair_eval_record, pair_eval_rows, pair_means, pair_model_inputs

STATS = ("rewards/chosen", "rewards/rejected", "rewards/accuracy")


class RewardModel:
    def __init__(self, recipe):
        self.recipe = recipe

    def model_kwargs(self, tokenizer) -> dict:
        """The model is loaded with a score head, which reads the last token before the padding."""
        return {"head": "score", "pad_token_id": tokenizer.pad_token_id}

    def collator(self, tokenizer) -> PairCollator:
        return PairCollator(tokenizer.pad_token_id, padding_free=self.recipe.data.packing,
                            flatten=flattens_packed_rows(self.recipe.model.attn_implementation))

    def loss(self, model) -> BradleyTerryLoss:
        return BradleyTerryLoss(self.recipe.reward_model.center_rewards_coefficient)

    def prepare(self, accelerator, model, loss, train_set, eval_sets, eval_loaders, collator) -> None:
        """Nothing: no reference."""

    def steps(self, feed):
        return feed


def _unwrapped(model):
    """The sequence-classification model under the strategy's wrapper and peft's (its `score` and config)."""
    from accelerate.utils import extract_model_from_parallel

    bare = extract_model_from_parallel(model)
    return bare.get_base_model() if hasattr(bare, "get_base_model") else bare


def last_tokens(batch: dict, pad_token_id: int | None) -> torch.Tensor:
    """[sequences] flat positions (row x width + column) of each padding-free sequence's last token that is not
    `pad_token_id`, where transformers' sequence-classification head reads a padded row."""
    segments = batch[SEQUENCE_INDEX].reshape(-1)
    count = batch[SEQUENCE_COUNT]
    positions = torch.arange(segments.numel(), device=segments.device)
    real = segments < count
    if pad_token_id is not None:
        real &= batch["input_ids"].reshape(-1) != pad_token_id
    last = torch.full((count + 1,), -1, dtype=torch.long, device=segments.device)
    return last.scatter_reduce(0, segments, torch.where(real, positions, -1), reduce="amax")[:count]


class BradleyTerryLoss:
    """The loop's loss for training.objective: reward (objectives/base.Loss): the pair loss on the model's scores,
    summed over the micro-batch's pairs."""

    unit_name = "pairs"
    checked = True  # no token-loss engine to check against the model's own: the score head is the model's

    def __init__(self, center_coefficient: float | None = None):
        self.center = center_coefficient
        self._window: torch.Tensor | None = None

    def check_against_model(self, accelerator, model, batch: dict) -> None:
        """Nothing to check (see `checked`)."""

    def units(self, batch: dict) -> torch.Tensor:
        return torch.full((), batch[PAIR_INDEX].numel(), device=batch["input_ids"].device, dtype=torch.long)

    def scores(self, model, batch: dict) -> torch.Tensor:
        """[sequences] fp32: each sequence's score (chosen first, then rejected)."""
        if SEQUENCE_INDEX not in batch:
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
            return out.logits[:, 0].float()
        bare = _unwrapped(model)
        per_token = []  # the score head's output at every position (its pooled output reads each row's last token)
        handle = bare.score.register_forward_hook(lambda _module, _args, output: per_token.append(output))
        try:
            model(**pair_model_inputs(batch), use_cache=False)
        finally:
            handle.remove()
        at = last_tokens(batch, bare.config.pad_token_id)
        return per_token[0][..., 0].reshape(-1)[at].float()

    def pair_losses(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss per pair, [pairs, STATS + 1] statistics) from the scores of [chosen..., rejected...]."""
        n = scores.shape[0] // 2
        chosen, rejected = scores[:n], scores[n:]
        losses = -F.logsigmoid(chosen - rejected)
        if self.center:
            losses = losses + self.center * (chosen + rejected) ** 2
        stats = torch.stack([chosen, rejected, (chosen > rejected).float(), torch.ones_like(chosen)], dim=1)
        return losses, stats.detach()

    def training_loss(self, model, batch: dict, num_items_in_batch) -> torch.Tensor:
        losses, stats = self.pair_losses(self.scores(model, batch))
        sums = stats.double().sum(0)
        self._window = sums if self._window is None else self._window + sums
        return losses.sum() / num_items_in_batch

    def window_metrics(self, accelerator) -> dict:
        """Means over the pairs of all ranks since the last log line (one all-reduce)."""
        record, self._window = pair_means(accelerator, self._window, STATS), None
        return record

    @torch.no_grad()
    def eval_rows(self, model, batch: dict, split: str = "eval") -> torch.Tensor:
        """Per pair: (loss, 1, reward chosen, reward rejected, correct)."""
        return pair_eval_rows(*self.pair_losses(self.scores(model, batch)))

    def eval_record(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        return pair_eval_record(sums)
