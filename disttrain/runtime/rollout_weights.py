"""The model an online-RL rollout samples from, and whether its generate() must run in step across ranks.

Under DDP and ZeRO-1/2 every rank holds the whole model: the forward has no collectives, each rank decodes on its
own (no synced_gpus). Under FSDP2 and ZeRO-3 no rank does, and each layer would be all-gathered for every
generated token -- the weights cross the network max_completion_length times per rollout. So the whole model is
gathered once for the rollout when it fits (as TRL's ds3_gather_for_generation does for ZeRO-3), and decoding
is again collective-free; when it does not fit, the per-layer path stays, with synced_gpus (a rank whose
completions have ended keeps joining the others' gathers), and the log says so.

The rule (rl.generation_weights: auto): the gathered model (its parameters at the dtype they compute in) plus
the rollout's KV cache must fit in 90% of the device's free memory (a GPU's free plus the allocator's cached
bytes; on CPU processes, the host's available memory), on every rank -- the ranks decide together, since the
gather is itself a collective. `make cost` prints the same sum for a recipe (its RL rows).
"""

from __future__ import annotations

import contextlib

import torch

from disttrain.runtime.backends import generating

HEADROOM = 0.9  # the share of free memory the gathered model and the KV cache may take
# the DeepSpeed engine's forward hooks (its forward prologue and epilogue: timers, ZeRO-3's external-parameter
# discovery over every module), idle while every weight is gathered
ENGINE_HOOKS = ("module_forward_pre_hook", "module_forward_post_hook")


def kv_cache_bytes(config, rows: int, tokens: int, element_size: int) -> int:
    """Keys and values of every layer for `rows` sequences of `tokens` tokens."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return 2 * text.num_hidden_layers * heads * head_dim * rows * tokens * element_size


def free_device_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    import psutil

    return psutil.virtual_memory().available


def _sharding(accelerator) -> str | None:
    """'fsdp2', 'zero3' or None (every rank holds the whole model)."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.FSDP:
        return "fsdp2"
    plugin = accelerator.state.deepspeed_plugin
    return "zero3" if plugin is not None and plugin.zero_stage == 3 else None


def _whole_bytes(module, sharding: str, compute_dtype: torch.dtype | None) -> int:
    """The model's parameters gathered, at the dtype the forward computes them in."""
    total = 0
    for param in module.parameters():
        numel = param.ds_numel if sharding == "zero3" else param.numel()  # a DTensor's numel is the whole one
        dtype = param.ds_tensor.dtype if sharding == "zero3" else param.dtype
        total += numel * (compute_dtype or dtype).itemsize
    return total


def _gib(value: float) -> str:
    return f"{value / 2 ** 30:.2f} GiB"


class RolloutWeights:
    """Owned by a run's rollouts (or its end-of-evaluation samples): decides, each rollout, how the policy is held
    while it samples, and says it in the log when the decision is new. `rl`: the section whose generation_weights
    chooses (None: auto); `what`, `once`: how the log line names the generation."""

    def __init__(self, accelerator, rl=None, what: str = "rollouts", once: str = "per rollout"):
        self.accelerator, self.rl, self.what, self.once = accelerator, rl, what, once
        self.sharding = _sharding(accelerator)
        self.said: str | None = None
        self.decided: tuple[tuple[int, int], bool] | None = None  # (the largest decode shape decided on, whole?)

    @property
    def collective(self) -> bool:
        """Whether a rollout is a collective (a gather, whole or per layer): every rank takes part."""
        return self.sharding is not None and self.accelerator.num_processes > 1

    @contextlib.contextmanager
    def model(self, model, decode_shape: tuple[int, int], whole: bool = False):
        """Yields (the bare model in eval mode, whether generate() needs synced_gpus). `decode_shape`: (rows per
        generate call, tokens per row at most); `whole`: gathered whole whatever the rule says (a vLLM push)."""
        with generating(self.accelerator, model) as module:
            if self.sharding is None:
                yield module, False
                return
            whole = whole or self._whole(module, decode_shape)
            if not whole:
                yield module, True
                return
            gather = _fsdp2_whole if self.sharding == "fsdp2" else _zero3_whole
            with gather(module if self.sharding == "fsdp2" else model):
                yield module, False

    def _whole(self, module, decode_shape: tuple[int, int]) -> bool:
        """The rule, decided again only for a rollout larger than any decided on (its KV cache grows): the model's
        size is fixed, and the memory free when a rollout starts is the training step's steady state."""
        if self.decided is not None and all(n <= d for n, d in zip(decode_shape, self.decided[0])):
            return self.decided[1]
        whole = self._decide(module, decode_shape)
        self.decided = (decode_shape, whole)
        return whole

    def _decide(self, module, decode_shape: tuple[int, int]) -> bool:
        choice = self.rl.generation_weights if self.rl is not None else "auto"
        compute = self._compute_dtype()
        weights = _whole_bytes(module, self.sharding, compute)
        element = (compute or next(module.parameters()).dtype).itemsize
        cache = kv_cache_bytes(module.config, *decode_shape, element)
        free = free_device_bytes(self.accelerator.device)
        fits = weights + cache <= HEADROOM * free
        if choice == "auto" and self.accelerator.num_processes > 1:  # every rank's memory: they gather together
            flag = torch.tensor([0.0 if fits else 1.0], device=self.accelerator.device)
            fits = float(self.accelerator.reduce(flag, reduction="max")) == 0.0
        whole = choice == "whole" or (choice == "auto" and fits)
        sizes = f"model {_gib(weights)} + KV cache {_gib(cache)}, {_gib(free)} free on rank 0"
        setting = f"; rl.generation_weights: {choice}" if self.rl is not None else ""
        said = (f"{self.what}: the whole model gathered once {self.once} ({sizes}{setting})"
                if whole else f"{self.what}: each layer gathered for every generated token, generate() in step across "
                f"ranks ({sizes}{'' if choice != 'auto' else ': more than 90% of it'}{setting})")
        if said.split(" (")[0] != (self.said or "").split(" (")[0]:
            self.accelerator.print(said)
        self.said = said
        return whole

    def _compute_dtype(self) -> torch.dtype | None:
        """The dtype the weights are gathered in under mixed precision (None: their own)."""
        precision = str(getattr(self.accelerator, "mixed_precision", "no"))
        if self.sharding == "fsdp2":
            plugin = self.accelerator.state.fsdp_plugin
            policy = getattr(plugin, "mixed_precision_policy", None)
            return getattr(policy, "param_dtype", None)
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


@contextlib.contextmanager
def _fsdp2_whole(module):
    """Every FSDP2 unit unsharded for the rollout and kept so through its forwards (reshard-after-forward off),
    then resharded and its setting put back. FSDP2's public set_reshard_after_forward cannot say what it was, so
    the per-group setting is saved and restored as torch holds it."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    saved = []
    for unit in units:
        state = unit._get_fsdp_state()
        saved.append((state, state._auto_reshard_after_forward,
                      [group.post_forward_mesh_info for group in state._fsdp_param_groups]))
        unit.set_reshard_after_forward(False, recurse=False)
    # on GPUs (NCCL) the all-gathers go in flight together; on CPU processes (gloo) one at a time, as FSDP2's own
    # forward issues them there: gloo would run several on one connection from its two work threads at once,
    # a path nothing else takes (a rank died in native code sampling under FSDP2 + TP once in a CI run)
    together = all(group.device.type != "cpu" for unit in units for group in unit._get_fsdp_state()._fsdp_param_groups)
    for handle in [unit.unshard(async_op=together) for unit in units]:
        if handle is not None:
            handle.wait()
    try:
        with _casts_only(units):
            yield
    finally:
        for state, auto, infos in saved:
            state._auto_reshard_after_forward = auto
            for group, info in zip(state._fsdp_param_groups, infos):
                group.post_forward_mesh_info = info
        for unit in units:
            unit.reshard()


@contextlib.contextmanager
def _casts_only(units):
    """While every unit is unsharded, FSDP2's forward hooks have nothing to gather or free, yet run at every decode
    step of every unit (state bookkeeping, profiler ranges, a dynamo-disabled wrapper: ~1/3 of the tiny model's
    decode time here). Each is taken out of its module's hook dict for the rollout -- or, where the unit's
    mixed-precision policy casts inputs or outputs, replaced by those casts alone, so the numbers are FSDP2's -- and
    the dicts are put back in their order after. Hooks are recognised by the FSDPState method they wrap (a unit of
    several modules, as accelerate groups the final norm with the LM head, registers wrappers of them)."""
    import inspect

    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    pre, post = inspect.unwrap(FSDPState._pre_forward), inspect.unwrap(FSDPState._post_forward)
    saved = []
    for unit in units:
        state = unit._get_fsdp_state()
        policy = state._mp_policy
        light = {pre: (lambda _, args, kwargs, s=state: s._cast_forward_inputs(args, kwargs))
                 if policy.cast_forward_inputs and policy.param_dtype is not None else None,
                 post: (lambda _, inputs, output, s=state: s._cast_output_dtype(output))
                 if policy.output_dtype is not None else None}
        for hooks in (unit._forward_pre_hooks, unit._forward_hooks):
            saved.append((hooks, list(hooks.items())))
            for key, hook in list(hooks.items()):
                if (ours := inspect.unwrap(hook)) in light:
                    if light[ours] is None:
                        del hooks[key]
                    else:
                        hooks[key] = light[ours]
    try:
        yield
    finally:
        for hooks, items in saved:
            hooks.clear()
            hooks.update(items)


@contextlib.contextmanager
def _zero3_whole(engine):
    """ZeRO-3: every partitioned parameter gathered in one flat all-gather (DeepSpeed's all_gather_coalesced, the
    call its own prefetch makes for a module; GatheredParameters would issue one per parameter) and re-partitioned
    after; the per-module fetch/release hooks and the engine's forward hooks taken off meanwhile and put back (as
    TRL's unwrap_model_for_generation does). DeepSpeed's memory-efficient linear, which replaces torch's F.linear
    for the whole run, saves activations for a backward that sampling never runs and costs an autograd function
    per call (1.5x the tiny model's decode time here): torch's own is put back meanwhile."""
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses, ZeroParamStatus

    optimizer = getattr(engine, "optimizer", None)
    # the parameters' fetch/release hooks: the ZeRO-3 optimizer's, or an engine without one (a frozen teacher or
    # reference: deepspeed.initialize without an optimizer) holds DeepSpeedZeRoOffload itself in its place
    offload = getattr(optimizer, "parameter_offload", None) or (optimizer if hasattr(optimizer, "forward_hooks")
                                                                else None)
    if offload is not None:  # parameters a forward without a backward left gathered or in flight (an evaluation's
        offload.empty_partition_cache()  # prefetch): released first, else the gather below skips them
    linear = torch.nn.functional.linear
    params = [p for p in engine.module.parameters() if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
    if params:
        params[0].all_gather_coalesced(params).wait()
    torch.nn.functional.linear = getattr(InsertPostInitMethodToModuleSubClasses, "linear_bk", linear)
    # the root's start-of-forward hook too: its step reset compares the module trace across ranks (a broadcast)
    # at every decode step while the trace records, as it does after each rollout
    start = None
    if offload is not None:
        for param in offload.module.parameters():
            param.ds_active_sub_modules.clear()
        for hook in offload.forward_hooks + offload.backward_hooks:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        handle = getattr(offload, "fwd_pre_hook", None)
        if handle is not None and handle.id in offload.module._forward_pre_hooks:
            start = (handle.id, offload.module._forward_pre_hooks.pop(handle.id))
    engine_hooks = [getattr(engine, name, None) for name in ENGINE_HOOKS]
    for hook in engine_hooks:  # the engine's own, which walk every module at every forward
        if hook is not None:
            hook.remove()
    try:
        yield
    finally:
        torch.nn.functional.linear = linear
        for name, hook in zip(ENGINE_HOOKS, engine_hooks):
            if hook is not None:
                setattr(engine, name, getattr(engine, f"_create_{name}")())
        if offload is not None:  # re-registering the root invalidates the prefetch trace of the training steps
            offload._register_deepspeed_module(offload.module)
        if start is not None:  # first again, where DeepSpeed registered it
            hooks = offload.module._forward_pre_hooks
            rest = list(hooks.items())
            hooks.clear()
            hooks[start[0]] = start[1]
            hooks.update(rest)
        if params:
            params[0].partition(param_list=params, has_been_updated=False)
