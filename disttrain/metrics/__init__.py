"""What a run measures and logs.

    log.py         metrics.jsonl, the progress bar, read_metrics for tools and tests
    trackers.py    what wandb / tensorboard / mlflow are given (the recipe as flat scalars, the run name)
    throughput.py  FLOPs processed, the device's peak, peak memory: MFU in every run
    flops.py       training FLOPs per token (6N + attention; LoRA-aware; packed sequences apart)
    hardware.py    GPU memory, dense bf16 peaks and default prices (also read by the cost planner)
"""
