"""The parts of a vision-language model -- its image encoder, the projector into the language model, the language
model with its head -- found by the module names transformers gives them, so `model.freeze` and LoRA's targets
need no wrapping policy or module list per family.

transformers names them alike across families: the encoder `vision_tower` (LLaVA, Gemma 3, Mistral 3), `visual`
(Qwen-VL) or `vision_model` (Idefics3/SmolVLM, Mllama); the projector `multi_modal_projector` (LLaVA, Gemma 3,
Mllama), `connector` (Idefics3/SmolVLM) or the encoder's own `merger` (Qwen-VL, inside `visual`); everything else
(`language_model`, `lm_head`) is the language model.
"""

from __future__ import annotations

import torch

VISION = frozenset({"vision_tower", "visual", "vision_model"})
PROJECTOR = frozenset({"multi_modal_projector", "connector", "merger", "mm_projector"})
PARTS = ("vision", "projector", "language")
DEFAULT_FROZEN = ("vision",)  # as LLaMA-Factory and most published recipes: the encoder stays as pretrained


def part_of(name: str) -> str:
    """vision, projector or language, from a parameter's or a module's dotted name (a peft prefix included)."""
    pieces = set(name.split("."))
    if pieces & PROJECTOR:  # before vision: Qwen-VL's merger sits inside `visual`
        return "projector"
    return "vision" if pieces & VISION else "language"


def freeze(model, frozen) -> None:
    """requires_grad off for every parameter of the frozen parts."""
    for name, param in model.named_parameters():
        if part_of(name) in frozen:
            param.requires_grad_(False)


def lora_targets(model, target_modules, frozen) -> list[str]:
    """The full names of the linear layers LoRA adapts: those `target_modules` names (or, for "all-linear",
    every linear layer but the output head, as peft's all-linear) inside the parts not frozen."""
    head = model.get_output_embeddings()
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or module is head or part_of(name) in frozen:
            continue
        if target_modules == "all-linear" or name.rsplit(".", 1)[-1] in target_modules:
            names.append(name)
    return names


def trained_parts(frozen) -> list[str]:
    return [p for p in PARTS if p not in frozen]
