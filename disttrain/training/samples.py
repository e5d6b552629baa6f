"""Sample generations: a few fixed prompts answered greedily at each evaluation, so a run shows what it learned.

The prompts are the first rows of the eval set (or of the training set without one), cut where their
targets start (the prompt a user would send; a pair's prompt for preference data). Every rank generates the
same prompts for exactly `logging.sample_tokens` steps (no early stop at EOS, the text is cut at the first EOS
afterwards): under FSDP2 and ZeRO-3 the sharded weights are gathered whole once for the evaluation's samples
when they fit (runtime/rollout_weights.py, as for a rollout), else each forward step gathers them, and under
tensor or expert parallelism each forward step is itself collective, so all ranks must run the same number of
steps or one would wait for the others forever. Logged to metrics.jsonl
({"samples": [{"prompt", "completion"}]}), TensorBoard (text), wandb (a table) and mlflow (an artifact).
"""

from __future__ import annotations

import torch

from disttrain.data import IGNORE_INDEX
from disttrain.data.vision import IMAGES_KEY, vision_of
from disttrain.runtime.rollout_weights import RolloutWeights

PROMPT_TOKENS_WITHOUT_TARGETS = 16  # a document (continued pretraining): its first tokens are the prompt


def sample_prompts(rows, count: int) -> list[list[int]]:
    """Token ids of up to `count` prompts from dataset rows (SFT rows, preference pairs or RL prompts)."""
    prompts = []
    for i in range(min(count, len(rows))):
        row = rows[i]
        if "prompt_ids" in row:  # online RL's prompts: as they are
            prompts.append(list(row["prompt_ids"]))
            continue
        ids, labels = (row["chosen_input_ids"], row["chosen_labels"]) if "chosen_input_ids" in row else \
            (row["input_ids"], row["labels"])
        if "position_ids" in row:  # a packed row: its first example
            ends = [j for j, p in enumerate(row["position_ids"]) if p == 0][1:2]
            ids, labels = ids[:ends[0]] if ends else ids, labels[:ends[0]] if ends else labels
        start = next((j for j, label in enumerate(labels) if label != IGNORE_INDEX and j > 0), 0)
        document = start <= 1  # targets from the first tokens on (after a BOS at most): no prompt to cut
        prompts.append(list(ids[:PROMPT_TOKENS_WITHOUT_TARGETS] if document else ids[:start]))
    return prompts


def sample_images(rows, count: int) -> list[list[str]]:
    """The images of the prompts sample_prompts takes (vision-language rows; none elsewhere)."""
    return [list(rows[i].get(IMAGES_KEY) or []) for i in range(min(count, len(rows)))]


def sample_weights(accelerator) -> RolloutWeights:
    """How the samples hold a sharded model: gathered whole once when it fits (rl.generation_weights' auto)."""
    return RolloutWeights(accelerator, what="samples", once="for each evaluation's samples")


@torch.no_grad()
def generate(accelerator, model, tokenizer, prompts: list[list[int]], new_tokens: int,
             images: list[list[str]] | None = None, weights: RolloutWeights | None = None) -> list[dict]:
    """Greedy completions of every prompt (with its images, for a vision-language model), the same number of
    forward steps on every rank; a completion is cut after its first end token (EOS, or one the model's
    generation config ends turns with: Gemma's <end_of_turn>). `weights`: how a sharded model is held meanwhile
    (gathered whole once for all the prompts when it fits, as for a rollout)."""
    samples, vision = [], vision_of(tokenizer)
    weights = weights or sample_weights(accelerator)
    shape = (1, max(map(len, prompts), default=0) + new_tokens)  # one prompt per generate call
    with weights.model(model, shape) as (module, _):
        ends = {tokenizer.eos_token_id} | set(_ids(getattr(module.generation_config, "eos_token_id", None)))
        for k, ids in enumerate(prompts):
            inputs = torch.tensor([ids], device=accelerator.device)
            pixels = {}
            if vision is not None and images and images[k]:
                pixels = {**vision.pixels(images[k]), **vision.token_types(inputs.cpu())}
                pixels = {name: value.to(accelerator.device) for name, value in pixels.items()}
            out = module.generate(input_ids=inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=new_tokens,
                                  do_sample=False, use_cache=True, eos_token_id=None,
                                  pad_token_id=tokenizer.pad_token_id, **pixels)
            new = out[0, len(ids):].tolist()
            end = next((j for j, t in enumerate(new) if t in ends), None)
            new = new if end is None else new[:end + 1]
            samples.append({"prompt": tokenizer.decode(ids), "completion": tokenizer.decode(new)})
    return samples


def _ids(value) -> list[int]:
    return [] if value is None else [value] if isinstance(value, int) else list(value)


def log_to_trackers(accelerator, samples: list[dict], step: int) -> None:
    """TensorBoard gets a Markdown table as text, wandb a table, mlflow the Markdown table as a run artifact
    (its metrics take numbers only)."""
    rows = "\n".join(f"| {s['prompt']!r} | {s['completion']!r} |" for s in samples)
    markdown = "| prompt | completion |\n|---|---|\n" + rows
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            tracker.writer.add_text("samples", markdown, step)
        elif tracker.name == "mlflow":
            import mlflow

            mlflow.log_text(markdown + "\n", f"samples/step-{step:06d}.md")
        elif tracker.name == "wandb":
            import wandb

            table = wandb.Table(columns=["prompt", "completion"],
                                data=[[s["prompt"], s["completion"]] for s in samples])
            tracker.log({"samples": table}, step=step)


class Sampler:
    """What the loop calls after each evaluation: generate, log, keep the last samples."""

    def __init__(self, accelerator, model, tokenizer, prompts: list[list[int]], new_tokens: int, log,
                 images: list[list[str]] | None = None):
        self.accelerator, self.model, self.tokenizer = accelerator, model, tokenizer
        self.prompts, self.new_tokens, self.log, self.images = prompts, new_tokens, log, images
        self.weights = sample_weights(accelerator)
        self.last: list[dict] = []

    def __call__(self, step: int) -> None:
        self.last = generate(self.accelerator, self.model, self.tokenizer, self.prompts, self.new_tokens, self.images,
                             self.weights)
        self.log({"samples": self.last}, step)
        if self.accelerator.is_main_process:
            log_to_trackers(self.accelerator, self.last, step)


def build_sampler(accelerator, model, tokenizer, recipe, eval_sets: dict, train_set, log) -> Sampler | None:
    """logging.samples prompts from the first eval set (or the training set); None when disabled or streamed."""
    rows = next(iter(eval_sets.values()), train_set)
    if not recipe.logging.samples or rows is None or not recipe.generates_text():
        return None
    count = recipe.logging.samples
    return Sampler(accelerator, model, tokenizer, sample_prompts(rows, count), recipe.logging.sample_tokens, log,
                   sample_images(rows, count))
