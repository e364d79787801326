"""The worker: what one rank computes. A step's plan (which tokens, which KV blocks) goes through
the model over the paged KV pool and comes back as logits.

    kv_pool.py         K and V of every layer in preallocated blocks (the storage; the engine's
                       block manager decides which blocks a request holds)
    attention.py       paged attention over the pool (native kernels, torch fallback)
    spec_attention.py  the same for chunks that end in speculative guesses
    runner.py          StepPlan -> tensors -> forward -> logits; fused decode steps

Rank 0 of a tensor-parallel group runs one inside the engine; the other ranks run one each in
their own process (inferd.distributed.tp_worker). It knows nothing of requests or scheduling.
"""
