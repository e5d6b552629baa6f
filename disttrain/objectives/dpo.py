"""Preference tuning (training.objective: dpo): the DPO family on chosen/rejected pairs batched together, or KTO
on examples judged one by one, each batched with its KL partner (kto.py), against a reference made before the
first update (preference.py)."""

from __future__ import annotations

from disttrain.data.collation import flattens_packed_rows
from disttrain.data.preference import PairCollator
from disttrain.data.unpaired import DESIRABLE, KL_PREFIX
from disttrain.objectives.kto import KTOLoss, balance_note
from disttrain.objectives.preference import PreferenceLoss, prepare_reference
from disttrain.runtime import guards


class DPO:
    def __init__(self, recipe):
        self.recipe = recipe
        self.kto = recipe.preference.loss == "kto"

    def model_kwargs(self, tokenizer) -> dict:
        """The causal LM as it is."""
        return {}

    def collator(self, tokenizer) -> PairCollator:
        layout = dict(padding_free=self.recipe.data.packing,
                      flatten=flattens_packed_rows(self.recipe.model.attn_implementation))
        if self.kto:  # each example, then its KL partner
            return PairCollator(tokenizer.pad_token_id, sides=("", KL_PREFIX), carried=(DESIRABLE,), sides_apart=True,
                                **layout)
        return PairCollator(tokenizer.pad_token_id, **layout)

    def loss(self, model) -> PreferenceLoss:
        return (KTOLoss if self.kto else PreferenceLoss)(model, self.recipe.preference, self.recipe.reference_mode())

    def prepare(self, accelerator, model, loss, train_set, eval_sets, eval_loaders, collator) -> None:
        """The reference before any update: log-probs of every pair with the initial weights (read back on
        resume), or a frozen copy sharded like the policy; LoRA's is the policy with its adapters disabled."""
        guards.at("preparing the reference (preference tuning)")
        if self.kto:
            desirable = sum(train_set[DESIRABLE])
            note = balance_note(self.recipe.preference, desirable, len(train_set) - desirable)
            accelerator.print(note or f"KTO: {desirable} desirable and {len(train_set) - desirable} undesirable "
                              "examples")
        prepare_reference(accelerator, self.recipe, model, loss, train_set, eval_sets, eval_loaders, collator)

    def steps(self, feed):
        """The feed's batches as they are."""
        return feed
