"""Preference tuning (training.objective: dpo): the DPO family on chosen/rejected pairs batched together,
against a reference made before the first update (preference.py)."""

from __future__ import annotations

from disttrain.data.preference import PairCollator
from disttrain.objectives.preference import PreferenceLoss, prepare_reference
from disttrain.runtime import guards


class DPO:
    def __init__(self, recipe):
        self.recipe = recipe

    def model_kwargs(self, tokenizer) -> dict:
        """The causal LM as it is."""
        return {}

    def collator(self, tokenizer) -> PairCollator:
        return PairCollator(tokenizer.pad_token_id)

    def loss(self, model) -> PreferenceLoss:
        return PreferenceLoss(model, self.recipe.preference, self.recipe.reference_mode())

    def prepare(self, accelerator, model, loss, train_set, eval_sets, eval_loaders, collator) -> None:
        """The reference before any update: log-probs of every pair with the initial weights (read back on
        resume), or a frozen copy sharded like the policy; LoRA's is the policy with its adapters disabled."""
        guards.at("preparing the reference (preference tuning)")
        prepare_reference(accelerator, self.recipe, model, loss, train_set, eval_sets, eval_loaders, collator)

    def steps(self, feed):
        """The feed's batches as they are."""
        return feed
