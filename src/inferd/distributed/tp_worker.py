"""A tensor-parallel rank other than 0: load its shard, build its share of the KV pool, then run
every step rank 0 sends until rank 0 says stop (or goes away).

Started by `TensorParallelGroup` as `python -m inferd.distributed.tp_worker` with its spec pickled
on standard input. It exits non-zero with one line if anything fails, which rank 0 sees as a dead
rank; it exits (zero) when rank 0's process is gone.
"""
from __future__ import annotations

import logging
import os
import pickle
import sys


def _die_with_parent():
    """SIGKILL when the process that started us dies (Linux), so no rank outlives its engine."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def serve(spec: dict) -> int:
    import signal

    # the server decides when ranks stop: a Ctrl-C to the process group must not kill a rank mid-step
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rank, world, cfg = spec["rank"], spec["world"], spec["cfg"]
    log = logging.getLogger("inferd")
    parent = spec["parent"]

    def alive() -> bool:  # under torchrun (no parent of ours) rank 0's loss shows as a failed collective
        return parent is None or os.getppid() == parent

    import torch

    from inferd.distributed.comm import CollectiveError, connect

    torch.set_num_threads(spec["threads"])
    device = torch.device(f"cuda:{rank}" if cfg.device.startswith("cuda") else "cpu")
    try:
        _, comm = connect(spec["backend"], rank, world, spec["store"], spec["shm"], device, ip=spec.get("ip"))
        from inferd.distributed.tensor_parallel import apply_tp, shard_of
        from inferd.loading.loader import load_model
        from inferd.model.config import attention_scale
        from inferd.worker.attention import PagedAttention
        from inferd.worker.kv_pool import KVPool, kv_cache_dtype, kv_layout
        from inferd.worker.runner import ModelRunner
        from inferd.worker.spec_attention import SpecPagedAttention

        lc = cfg.load_config(with_tokenizer=False)
        if device.type == "cuda":
            lc.device = str(device)
        loaded = load_model(lc, shard=lambda m: apply_tp(m, shard_of(m.cfg, rank, world), comm))
        model, mcfg = loaded.model, loaded.config
        setup = comm.recv_obj(alive)
        if setup is None:
            return 0
        kv_dtype = kv_cache_dtype(setup["kv_dtype"], model.dtype)
        layout = kv_layout(setup["window"], mcfg.num_hidden_layers)  # rank 0's, from the same windows
        pool = KVPool(layout.group_size, setup["num_blocks"] + (layout.num_groups > 1), setup["block_size"],
                      model.layers[0].n_kv, mcfg.head_dim, kv_dtype, model.device)
        if setup["speculative"]:  # verify chunks of up to k + 1 rows through the decode kernel, as rank 0's
            attn = SpecPagedAttention(pool, mcfg.head_dim, setup["window"], scale=attention_scale(mcfg), layout=layout,
                                      softcap=mcfg.attn_logit_softcapping, max_rows=cfg.num_speculative_tokens + 1)
        else:
            attn = PagedAttention(pool, mcfg.head_dim, setup["window"], scale=attention_scale(mcfg), layout=layout,
                                  softcap=mcfg.attn_logit_softcapping)
        lora = None
        if cfg.enable_lora:  # this rank's share of every adapter; rank 0 sends the slot writes
            from inferd.config import lora_module
            from inferd.distributed.tensor_parallel import shard_lora
            from inferd.worker.lora import LoRAManager

            mine = shard_of(mcfg, rank, world)
            lora = LoRAManager(model, mcfg, cfg.max_loras, cfg.max_lora_rank, lambda w: shard_lora(w, mine, mcfg))
            for m in cfg.lora_modules or []:
                lora.add(*lora_module(m))
        runner = ModelRunner(model, attn, enforce_eager=True, comm=comm, lora=lora)
        from inferd.distributed.comm import ready_counts
        from inferd.quant.linear import weight_bytes

        comm.all_reduce_(ready_counts(rank, world, weight_bytes(model)))  # rank 0 learns every rank is ready
        comm.counts.clear()
        log.info("rank %d of %d ready", rank, world)
        while True:
            step = comm.recv_obj(alive)
            if step is None:
                return 0
            if isinstance(step, tuple) and step[0] == "lora":  # rank 0 loaded or dropped an adapter
                _, op, name, path = step
                lora.add(name, path) if op == "add" else lora.remove(name)
                continue
            runner.run(step)
    except CollectiveError as e:
        if not alive():  # rank 0 went first: nothing to report
            return 0
        log.error("tensor-parallel rank %d: %s", rank, e)
        return 1
    except Exception as e:  # noqa: BLE001 - one line for the log; rank 0 reports the fault
        log.error("tensor-parallel rank %d failed: %s: %s", rank, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return 1


def run_torchrun_rank(cfg, rank: int, world: int) -> int:
    """A rank other than 0 that torchrun started: the worker loop, over gloo (or nccl)."""
    from inferd.distributed.comm import torchrun_backend

    backend = torchrun_backend(cfg.tensor_parallel_backend, cfg.device)
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # ranks sharing this host's cores
    threads = cfg.threads or max(1, len(os.sched_getaffinity(0)) // per_host)
    spec = {"cfg": cfg, "rank": rank, "world": world, "backend": backend, "store": None, "shm": None,
            "threads": threads, "parent": None}
    return serve(spec)


def main():
    spec = pickle.loads(sys.stdin.buffer.read())
    _die_with_parent()
    if spec.get("cpus"):
        os.sched_setaffinity(0, spec["cpus"])
    logging.basicConfig(level=spec.get("log_level", logging.INFO), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s %(name)s (tp rank {spec['rank']}): %(message)s")
    code = serve(spec)
    sys.stdout.flush()
    os._exit(code)  # no interpreter teardown: torch's threads and the mapped segment go with the process


if __name__ == "__main__":
    main()
