"""rl.engine: vllm -- completions sampled by a vLLM server through TRL's own client (trl.generation.vllm_client.
VLLMClient), the engine RL users run at scale: the server decodes on GPUs of its own while the trainer trains.

- Before the model loads: the server must answer at rl.vllm.server within rl.vllm.timeout_s and vLLM must be
  importable (TRL's client and its NCCL weight transfer need it); settings only the in-process engines take are
  refused. One line each.
- Each rank sends its prompts, one request per prompt (num_generations completions, the recipe's sampling settings,
  the prompt's seed: the same completions whichever rank sends it, as far as the server is deterministic), and
  gets each completion's tokens and the server's log-probs of them.
- Before a rollout that follows an optimizer step, the main process pushes the policy's weights (gathered whole
  under FSDP2 / ZeRO-3, LoRA's update added out of place, names as the checkpoint has them) over TRL's
  weight-transfer group, then resets the server's prefix cache.
- The server's log-probs differ from the trainer's (another kernel, another precision): the loss is corrected by
  TRL's importance-sampling weights (rl.vllm.importance_sampling; engine_weights below).

Unverified here: vLLM cannot be installed on this project's machines nor carried to the lent GPU machine. The CPU
tests cover the refusals, the requests and the pushed names (against a stand-in client), and the correction (the
loss with it equals TRL's on fixed inputs).
"""

from __future__ import annotations

import importlib.util
import math
from concurrent.futures import ThreadPoolExecutor

import torch

from disttrain.errors import DisttrainError


def check(rl) -> None:
    """What can be known before the model loads: settings, the server, vLLM itself."""
    if rl.rows_per_generate is not None or rl.generation_weights != "auto":
        raise DisttrainError("rl.engine: vllm samples on the server, which batches as it likes and holds its own "
                             "weights: remove rl.rows_per_generate / rl.generation_weights (in-process engines only)")
    import requests

    url = rl.vllm.server.rstrip("/")
    try:
        answered = requests.get(f"{url}/health", timeout=max(rl.vllm.timeout_s, 0.1)).status_code == 200
    except requests.exceptions.RequestException as exc:
        answered, reason = False, type(exc).__name__
    else:
        reason = "it answered, but not healthy"
    if not answered:
        raise DisttrainError(f"rl.vllm.server: no vLLM server answers at {url}/health ({reason}); start one "
                             "(VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{\"backend\": "
                             "\"nccl\"}' --logprobs-mode processed_logprobs --max-logprobs -1) or set rl.vllm.server")
    if importlib.util.find_spec("vllm") is None:
        raise DisttrainError("rl.engine: vllm needs vLLM in the trainer's environment too (TRL's client and its "
                             "weight transfer use it): pip install 'trl[vllm]', or use rl.engine: generate")


def pushed_name(name: str) -> str | None:
    """A policy parameter's name as the server's checkpoint has it (None: not pushed): peft's wrapping taken off,
    its adapters (merged into the weights before the push) left out, modules_to_save's trained copy under its own
    name."""
    if "lora_" in name or "original_module" in name:
        return None
    name = name.removeprefix("base_model.model.").replace(".base_layer", "")
    return name.replace("modules_to_save.default.", "")


@torch.no_grad()
def merged_weights(module) -> list[tuple[str, torch.Tensor]]:
    """(checkpoint name, weight) of every weight the server holds, LoRA's update added out of place: W + the
    active adapters' delta (peft's get_delta_weight), the model itself untouched (peft's merge_adapter then
    unmerge_adapter would leave W off by the rounding of two additions at every push)."""
    deltas = {}
    for path, layer in module.named_modules():
        if hasattr(layer, "get_delta_weight") and hasattr(layer, "base_layer"):
            for adapter in layer.active_adapters:
                if adapter in getattr(layer, "lora_A", {}):
                    delta = layer.get_delta_weight(adapter)
                    key = f"{path}.base_layer.weight"
                    deltas[key] = deltas[key] + delta if key in deltas else delta
    named = []
    for name, param in module.named_parameters():
        target = pushed_name(name)
        if target is not None:
            named.append((target, param.detach() + deltas[name].to(param.dtype) if name in deltas else param.detach()))
    return named


class VLLMEngine:
    """One per rank: a client for generation (the main process's also pushes the weights)."""

    def __init__(self, rl, client_factory=None):
        self.rl, self.client = rl, None
        self.pushed_at: int | None = None  # the optimizer step whose weights the server holds
        self._factory = client_factory  # tests: a stand-in for TRL's VLLMClient

    def _connect(self, accelerator):
        if self.client is not None:
            return
        if self._factory is None:
            from trl.generation.vllm_client import VLLMClient

            self._factory = VLLMClient
        try:
            self.client = self._factory(base_url=self.rl.vllm.server, group_port=self.rl.vllm.group_port,
                                        connection_timeout=self.rl.vllm.timeout_s)
            if accelerator.is_main_process:
                self.client.init_communicator(device=accelerator.device)
        except Exception as exc:  # ConnectionError, the server's refusals (no weight transfer, no dev mode)
            raise DisttrainError(f"rl.vllm.server ({self.rl.vllm.server}): {type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0][:200] if str(exc) else ''}") from None

    def push(self, accelerator, module, step: int) -> None:
        """The policy's current weights to the server, once per optimizer step. `module`: the bare model with every
        weight held whole on this rank (RolloutWeights' whole gather); every rank calls this."""
        self._connect(accelerator)
        if self.pushed_at == step:
            return
        if accelerator.is_main_process:
            named = merged_weights(module)
            metadata = [(n, str(p.dtype).removeprefix("torch."), list(p.shape)) for n, p in named]
            with self.client.weight_update():
                self.client.update_named_params(metadata, iter(named))
            self.client.reset_prefix_cache()
        self.pushed_at = step

    def sample(self, prompts: list[list[int]], seeds: list[int], eos: list[int]) -> list[list[tuple]]:
        """Each prompt's num_generations completions -- (ids, truncated, the server's log-probs) -- one request
        per prompt with the prompt's seed."""
        rl = self.rl

        def send(index):
            out = self.client.generate(
                prompts=[prompts[index]], n=rl.num_generations, repetition_penalty=rl.repetition_penalty,
                temperature=rl.temperature, top_p=rl.top_p, top_k=rl.top_k or 0, min_p=rl.min_p or 0.0,
                max_tokens=rl.max_completion_length, logprobs=0, generation_kwargs={"seed": seeds[index]})
            group = []
            for ids, logprobs in zip(out["completion_ids"], out["logprobs"]):
                ended = bool(ids) and ids[-1] in eos
                group.append((list(ids), not ended, [lp[0] if lp else math.nan for lp in logprobs]))
            return group

        with ThreadPoolExecutor(max_workers=min(64, max(len(prompts), 1))) as pool:
            return list(pool.map(send, range(len(prompts))))


def engine_weights(trainer_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor, vllm) -> torch.Tensor:
    """TRL's importance-sampling correction of the engine/trainer mismatch (its vllm_importance_sampling_mode,
    GRPOTrainer._generate_and_score_completions): exp(trainer - server log-probs) per token, or per completion
    (the sum of its tokens' differences), then clipped to [min, max] (truncate) or zeroed outside it (mask).
    NaN server log-probs give a ratio of 1. [rows, tokens] (token modes) or [rows, 1] (sequence modes)."""
    diff = torch.nan_to_num((trainer_logps - sampling_logps) * mask, nan=0.0)
    mode = vllm.importance_sampling
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=vllm.importance_sampling_min, max=vllm.importance_sampling_max)
    low = vllm.importance_sampling_min if vllm.importance_sampling_min is not None else -math.inf
    return ratio.masked_fill((ratio < low) | (ratio > vllm.importance_sampling_max), 0.0)
