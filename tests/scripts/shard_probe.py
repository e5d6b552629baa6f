"""Launched by tests under `accelerate launch`: records which rows each rank receives, per epoch, through
the same recipe -> accelerator -> data -> loader path that train.py uses."""

from probe_run import finish, start

from disttrain import data

recipe, accelerator, tokenizer, train_set = start()
loader = accelerator.prepare(data.make_loader(train_set, recipe.training.micro_batch_size,
                                              data.Collator(tokenizer.pad_token_id), True, True))
seen = {}
for epoch in range(2):
    loader.set_epoch(epoch)
    seen[epoch] = [tuple(row[:n].tolist()) for batch in loader
                   for row, n in zip(batch["input_ids"], batch["num_tokens"])]
finish(recipe, accelerator, {"dataset": [list(r) for r in train_set["input_ids"]],
                             "type": str(accelerator.distributed_type),
                             "epochs": {e: [list(r) for r in rows] for e, rows in seen.items()}})
