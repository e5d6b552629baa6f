"""Sampling that depends on each completion's own seed only, in one batched generate() call.

transformers samples with torch.multinomial on the process's random stream, so a completion's tokens depend on
which other rows share its generate() call and in what order. Here generate() decodes greedily over scores that
carry each row's own Gumbel noise: argmax(log-softmax(logits / T) filtered + Gumbel) is an exact draw from the
filtered distribution (the Gumbel-max trick), and the noise of row r at its t-th generated token is a hash of
(r's seed, t, token id) -- counter-based, so the same on every device and for every batch layout, with no
generator state to fork or carry. Every strategy thus samples what one process samples, a resumed run samples
what the uninterrupted one did, and processes sharing a batch (TP groups) draw alike.

The filters are transformers' own warpers (temperature, top-k, top-p, min-p, repetition penalty), built from the
recipe's rl settings alone: generate() runs with a bare generation config in place of the checkpoint's, which
transformers would otherwise merge in (a repetition penalty, no_repeat_ngram_size, min_p or do_sample set by the
model's authors would change the samples while the loss assumes the recipe's distribution).
"""

from __future__ import annotations

import contextlib
import hashlib
import struct

import torch

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed 64-bit integer (splitmix64's increment)
_M1 = -4658895280553007687      # 0xBF58476D1CE4E5B9
_M2 = -7723592293110705685      # 0x94D049BB133111EB


def completion_seed(seed: int, batch: int, prompt_row: int, generation: int) -> int:
    """The seed of one completion: generation `generation` of the prompt at `prompt_row` in prompt batch `batch`
    (a step, or mu steps with rl.num_iterations). A hash of the four numbers, so distinct completions never share
    a stream (a linear mix of them did once a dataset had more rows than its multiplier)."""
    digest = hashlib.blake2b(struct.pack("<4q", seed, batch, prompt_row, generation), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # a non-negative int64


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical right shift of int64 tensors (torch's >> keeps the sign)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (wrapping multiplication): every output bit depends on every input
    bit."""
    x = x ^ _shift_right(x, 30)
    x = x * _M1
    x = x ^ _shift_right(x, 27)
    x = x * _M2
    return x ^ _shift_right(x, 31)


def gumbel_noise(seeds: torch.Tensor, position: int, vocab: int) -> torch.Tensor:
    """[rows, vocab] float32 standard Gumbel noise of each row's seed at generated token `position`."""
    step = ((position + 1) * _GOLDEN + 2 ** 63) % 2 ** 64 - 2 ** 63  # wrapped to int64, as the tensors wrap
    row_keys = _mix(seeds + step)
    tokens = torch.arange(vocab, device=seeds.device, dtype=torch.int64) * _GOLDEN
    bits = _shift_right(_mix(row_keys.unsqueeze(1) + tokens.unsqueeze(0)), 40)  # the top 24 bits
    uniform = (bits.to(torch.float32) + 0.5) / float(1 << 24)  # in (0, 1), never 0 or 1
    return -torch.log(-torch.log(uniform))


class SeededGumbel:
    """The last logits processor: each row's Gumbel noise added to its filtered scores, so that generate()'s
    greedy argmax is that row's sample. `prompt_length`: the (padded) prompt's length, where generation starts."""

    def __init__(self, seeds: list[int], prompt_length: int, device):
        self.seeds = torch.tensor(seeds, dtype=torch.int64, device=device)
        self.prompt_length = prompt_length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        noise = gumbel_noise(self.seeds.to(scores.device), input_ids.shape[1] - self.prompt_length, scores.shape[-1])
        return scores.float() + noise


class WithoutPadding:
    """A processor that reads the tokens so far (the repetition penalty), shown each row without its left padding:
    the padded positions repeat the row's first real token, so the pad token (often EOS) is not penalised in the
    rows that happen to be padded, and a row's draw does not depend on the rows beside it."""

    def __init__(self, processor, pads: list[int]):
        self.processor, self.pads = processor, pads

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if any(self.pads):
            input_ids = input_ids.clone()
            for row, pad in enumerate(self.pads):
                input_ids[row, :pad] = input_ids[row, pad]
        return self.processor(input_ids, scores)


def processors(rl, seeds: list[int], prompt_length: int, device, pads: list[int] | None = None):
    """transformers' warpers for the recipe's sampling settings, in the order its sampling applies them, then the
    rows' noise. `pads`: each row's left padding."""
    from transformers import LogitsProcessorList
    from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                        TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    steps = []
    if rl.repetition_penalty != 1.0:
        steps.append(WithoutPadding(RepetitionPenaltyLogitsProcessor(rl.repetition_penalty), pads or [0] * len(seeds)))
    if rl.temperature != 1.0:
        steps.append(TemperatureLogitsWarper(rl.temperature))
    if rl.top_k:
        steps.append(TopKLogitsWarper(rl.top_k))
    if rl.top_p < 1.0:
        steps.append(TopPLogitsWarper(rl.top_p))
    if rl.min_p:
        steps.append(MinPLogitsWarper(rl.min_p))
    steps.append(SeededGumbel(seeds, prompt_length, device))
    return LogitsProcessorList(steps)


@contextlib.contextmanager
def bare_generation_config(module, eos: list[int], pad_id: int, max_new_tokens: int, static_cache: bool = False):
    """`module.generation_config` replaced by one holding only where completions end and how long they may be:
    transformers fills a call's unset fields from the model's config, which would bring in the checkpoint's.
    `static_cache`: transformers' static KV cache (rl.engine: static), whose decode step it compiles on GPUs."""
    from transformers import GenerationConfig

    base = module.get_base_model() if hasattr(module, "get_base_model") else None  # peft: the model inside
    saved = [(m, m.__dict__["generation_config"]) for m in {id(m): m for m in (module, base) if m is not None}.values()
             if "generation_config" in m.__dict__]
    bare = GenerationConfig(do_sample=False, eos_token_id=eos, pad_token_id=pad_id, max_new_tokens=max_new_tokens,
                            use_cache=True, **({"cache_implementation": "static"} if static_cache else {}))
    for m, _ in saved:
        m.generation_config = bare
    try:
        yield bare
    finally:
        for m, config in saved:
            m.generation_config = config
