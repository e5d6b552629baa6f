"""The model in and out.

    family.py    what a family's config says (MoE routing and router loss, softcap, tied embeddings, TP plan,
                 heads, windowed layers), read once; the loss, FLOPs, loader and launch checks ask it
    params.py    parameter counts under every strategy and quantization
    loading.py   tokenizer and model (dtype, attention, checkpointing, 4-bit, LoRA via peft)
    export.py    the trained model as a standard HF dir (or adapter, optionally merged), from any strategy
    hub.py       output.push_to_hub: the token checked before training, final/ uploaded after it
    from_checkpoint.py  a checkpoint of any strategy back to the model in one process (`make export`, and
                 what `make eval` and the evaluation during training read)
"""
