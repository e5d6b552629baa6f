"""Launched under accelerate_configs/fsdp.yaml by tests: how much gradient memory FSDP2 holds between the
micro-batches of one accumulation window, with the recipe's setting and with the opposite one, and the dtype
gradients are reduced in. Same recipe -> accelerator -> model -> prepare path as train.py."""

from probe_run import finish, start

from disttrain import data
from disttrain.model import loading as modeling
from disttrain.training import optim


def held_gradients(model) -> dict:
    """Elements of gradient tensors this rank holds right now: unsharded (per FSDPParam, kept by no-sync
    micro-batches) and sharded (the local shard of the reduced gradient)."""
    from torch.distributed.fsdp import FSDPModule

    held = {"unsharded": 0, "sharded": 0, "params": 0, "reduce_dtypes": set()}
    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        for p in group.fsdp_params if group else []:
            held["params"] += p.sharded_param.numel()
            # gradients come in the compute dtype (param_dtype, None = unchanged) and are reduced in
            # reduce_dtype (None = as they come)
            held["reduce_dtypes"].add(str(p.reduce_dtype or p.param_dtype or p.orig_dtype))
            if p.unsharded_accumulated_grad is not None:
                held["unsharded"] += p.unsharded_accumulated_grad.numel()
            if hasattr(p, "_unsharded_param") and p._unsharded_param.grad is not None:
                held["unsharded"] += p._unsharded_param.grad.numel()
            if p.sharded_param.grad is not None:
                held["sharded"] += p.sharded_param.grad.to_local().numel()
    held["reduce_dtypes"] = sorted(held["reduce_dtypes"])
    return held


recipe, accelerator, tokenizer, train_set = start()
model = modeling.load_model(recipe.model, recipe.lora, sharded=True)
optimizer = optim.build_optimizer(model, recipe.training)
loader = data.make_loader(train_set, recipe.training.micro_batch_size, data.Collator(tokenizer.pad_token_id),
                          True, True)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
batches = iter(loader)
report = {}
for name, sync_each in (("recipe", recipe.distributed.fsdp_sync_each_micro_batch),
                        ("opposite", not recipe.distributed.fsdp_sync_each_micro_batch)):
    accelerator.gradient_state.plugin_kwargs["sync_each_batch"] = sync_each
    for micro in range(recipe.training.grad_accum):
        with accelerator.accumulate(model):
            batch = {k: v for k, v in next(batches).items() if k not in data.BOOKKEEPING_KEYS}
            accelerator.backward(model(**batch, use_cache=False).loss)
        if micro == 0:  # between the first and the second micro-batch of the window
            report[name] = {"sync_each_micro_batch": sync_each, **held_gradients(model)}
    optimizer.zero_grad(set_to_none=True)
finish(recipe, accelerator, report)
