"""The model in and out.

    loading.py   tokenizer and model (dtype, attention, checkpointing, 4-bit, LoRA via peft)
    export.py    the trained model as a standard HF dir (or adapter, optionally merged), from any strategy
    hub.py       output.push_to_hub: the token checked before training, final/ uploaded after it
    from_checkpoint.py  a checkpoint of any strategy back to the model in one process (`make export`, and
                 what `make eval` and the evaluation during training read)
"""
