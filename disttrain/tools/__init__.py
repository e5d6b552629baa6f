"""Tools for users, each `python -m disttrain.tools.<name>` and a Make target.

    doctor.py     `make doctor`: the machine before a run (commbench.py: the torchrun'd all_reduce sweep)
    diagnose.py   `make diagnose`: the failure class of a finished or dead run, from its logs
    cost.py       `make cost`: FLOPs, time, money and memory fit per strategy
    preflight.py  `make preflight`: a recipe on a shrunk model of its architecture, on CPU processes
    tiny.py       the tiny local model, tokenizer and synthetic data of the default run
    cluster.py    the one entry every cluster engine's nodes run: its variables -> `make train-*` for the node
    cluster_launch.py  what a cluster launch is (recipe, strategy, nodes, mesh, name, shared output), checked once
    k8s.py        `make k8s`: an indexed Job + headless Service (or Kubeflow's PyTorchJob) for a recipe
    sky.py        `make sky`: a SkyPilot task for a recipe
    ray_launch.py `make ray`: a Ray cluster's nodes each running the cluster entry
"""
