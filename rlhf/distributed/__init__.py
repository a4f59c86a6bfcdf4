"""The engine scaled out on Ray: one controller (the trainer, holding no resources) drives role
groups, each a set of ranks (one Ray actor per rank) that shard their model with FSDP2.

    placement.py   joins or starts Ray, reserves one placement group per run, starts the ranks
    host.py        the Ray actor of one rank: torch.distributed, and the roles it hosts
    ranks.py       a worker's view of its group: its share of a mini-batch, global sums
    fsdp.py        sharding, full state dicts (checkpoints, weight sync), offloading
    actor.py, critic.py, reference.py   one role per module, wrapping the local workers
    group.py       what the trainer calls: the local workers' methods, split over the ranks
    checkpointing.py   model/optimizer/scheduler stand-ins that `rlhf/checkpoint.py` writes as usual

The PPO loop does not change: `rlhf/roles.py` builds either the local workers or these groups.
"""
