"""Tensor parallelism: one model split across ranks (`inferd.model.tensor_parallel` is the rewrite).

    comm.py    how ranks talk: a shared-memory all-reduce on one host, torch.distributed otherwise
    group.py   rank 0: start the other ranks, shard the model, hand each step's plan over
    worker.py  ranks 1..N-1: load their shard, run the steps rank 0 sends
"""
