"""Everything that spans more than one process: the engine asks for it, and it never imports the
engine (what it runs is handed to it).

    comm.py            collectives: a shared-memory all-reduce/gather on one host, torch.distributed
                       (gloo, nccl) across hosts; CollectiveError when a rank is gone
    tensor_parallel.py the per-rank rewrite of a model (heads, MLP rows, vocabulary split)
    tp_group.py        rank 0's end of a tensor-parallel group: start, connect, hand over steps
    tp_worker.py       every other rank: its shard, its share of the KV pool, the steps rank 0 sends
    data_parallel.py   N engine replicas behind one engine client, each on its own cores
    policy.py          where a request goes (round robin, least loaded, prefix affinity): shared by
                       data parallelism and `inferd router`
    kv_transfer/       disaggregated prefill/decode: a producer's prompt KV handed to a consumer
    tmpdirs.py         private temporary directories (the engine's sockets, a TP rendezvous), named
                       after their process: removed at its exit, swept once it is gone
"""
