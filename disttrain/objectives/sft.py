"""Supervised fine-tuning: cross-entropy on the target tokens, normalised by their number over the whole
optimizer step (token_loss.py: chunked by default, never full logits)."""

from __future__ import annotations

from disttrain.data.collation import Collator, flattens_packed_rows
from disttrain.data.vision import with_images
from disttrain.objectives.token_loss import TokenLoss


class SFT:
    def __init__(self, recipe):
        self.recipe = recipe

    def model_kwargs(self, tokenizer) -> dict:
        """The causal LM as it is."""
        return {}

    def collator(self, tokenizer) -> Collator:
        """Padded rows (a vision-language model's with their images' pixels: data/vision.py)."""
        flatten = flattens_packed_rows(self.recipe.model.attn_implementation)
        return with_images(Collator(tokenizer.pad_token_id, flatten_packed=flatten), tokenizer)

    def loss(self, model) -> TokenLoss:
        return TokenLoss(model, self.recipe.training.loss_impl, self.recipe.model.router_balance)

    def prepare(self, accelerator, model, loss, train_set, eval_sets, eval_loaders, collator) -> None:
        """Nothing: SFT needs no reference."""

    def steps(self, feed):
        """The feed's batches as they are."""
        return feed
