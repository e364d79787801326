"""Tensor-parallel ranks 1..N-1 as Ray actors (`--distributed-executor-backend ray`).

Rank 0 stays the engine (scheduler, KV tables, sampler) in this process, which joins the cluster
as a Ray driver (`join_cluster`): the one at RAY_ADDRESS, or the one `ray start` left running here
when it answers, else a local cluster of its own. One placement group reserves a bundle per rank;
bundle 0 carries a sliver of this node's `node:<ip>` resource, so rank 0's reservation is where
rank 0 actually runs and the strategy (PACK: on this node while it fits, SPREAD: one node per rank)
places the rest. Every actor runs the same worker loop as an `mp` rank (`tp_worker.serve`).

A rank whose actor or node dies is seen two ways: its gloo peer fails at once in the middle of a
collective, and between steps `dead()` sees its `run` call fail (Ray's RayActorError).
"""
from __future__ import annotations

import logging
import os

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from inferd.distributed.executor import Executor, Placement
from inferd.distributed.ray_address import check_address, current_cluster_file, probe
from inferd.errors import InferdError

log = logging.getLogger("inferd")
PLACEMENT_TIMEOUT = float(os.environ.get("INFERD_RAY_PLACEMENT_TIMEOUT", "60"))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def join_cluster() -> None:
    """Connect this process to Ray and log one line saying how:
    - RAY_ADDRESS set: that cluster, or an InferdError when it does not answer (never a silent
      local cluster, never Ray's minutes of retries);
    - else the cluster `ray_current_cluster` names, when it answers from here within seconds;
    - else (no file, or a stale one, which gets its own line) a local cluster of this process.
    RAY_ADDRESS=auto reads as unset, RAY_ADDRESS=local always starts a local cluster."""
    if ray.is_initialized():
        return
    quiet = {"logging_level": logging.WARNING, "log_to_driver": True}
    address = os.environ.get("RAY_ADDRESS", "").strip()
    if address and address not in ("auto", "local"):
        check_address()
        try:
            ray.init(address=address, **quiet)
        except ConnectionError as e:
            raise InferdError(f"cannot join the Ray cluster at RAY_ADDRESS={address}: {_first_line(e)}") from None
        log.info("Ray: joined RAY_ADDRESS=%s", address)
        return
    path = current_cluster_file()
    recorded = None
    if address != "local":
        try:
            with open(path) as f:
                recorded = f.read().strip() or None
        except OSError:
            pass
    if recorded:
        try:
            why = probe(recorded)
            why = why and f"does not answer ({why})"
        except InferdError:
            why = "is not HOST:PORT"
        if why is None:
            try:
                ray.init(address=recorded, **quiet)
                log.info("Ray: joined the running cluster at %s (from %s)", recorded, path)
                return
            except (ConnectionError, RuntimeError) as e:
                why = f"answers, but Ray could not join it ({_first_line(e)})"
        log.warning("Ray: %s is stale: the cluster it names at %s %s; starting a local cluster", path, recorded, why)
    # "local", not None: given no address, ray.init would read the same file and wait on it
    ray.init(address="local", include_dashboard=False, **quiet)
    log.info("Ray: started a local cluster (%g CPUs)", ray.cluster_resources().get("CPU", 0))


@ray.remote(max_restarts=0)
class TensorParallelRank:
    """One rank: `run(spec)` is the worker loop, returning its exit code when rank 0 says stop."""

    def run(self, spec: dict) -> int:
        from inferd.distributed.tp_worker import serve

        logging.basicConfig(level=spec.get("log_level", logging.INFO),
                            format=f"%(asctime)s %(levelname)s %(name)s (tp rank {spec['rank']}): %(message)s")
        return serve(spec)


class RayExecutor(Executor):
    def __init__(self, cfg, world: int):
        join_cluster()
        cpus = cfg.threads or 1  # each rank's CPUs in its bundle; its OpenMP threads
        nodes = {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}
        here = ray.get_runtime_context().get_node_id()
        if here not in nodes:
            raise InferdError("this process is not on a node of the Ray cluster (a Ray client connection?): "
                              "run the server on a node started with `ray start`")
        ip = nodes[here]["NodeManagerAddress"]
        bundles = [{"CPU": cpus, f"node:{ip}": 0.001}] + [{"CPU": cpus} for _ in range(world - 1)]
        self.pg = placement_group(bundles, strategy=cfg.ray_placement_strategy)
        ready, _ = ray.wait([self.pg.ready()], timeout=PLACEMENT_TIMEOUT)
        if not ready:
            remove_placement_group(self.pg)
            free = ray.available_resources().get("CPU", 0)
            raise InferdError(f"Ray could not place {world} ranks of {cpus} CPU(s) each ({cfg.ray_placement_strategy}, "
                              f"rank 0 on this node) within {PLACEMENT_TIMEOUT:.0f} s: the cluster has {free:g} CPU(s) "
                              f"free over {len(nodes)} node(s)")
        where = placement_group_table(self.pg)["bundles_to_node_id"]
        self.placements = [Placement(where[r], nodes[where[r]]["NodeManagerAddress"], None, cpus) for r in range(world)]
        self.actors: dict[int, object] = {}
        self.runs: dict[int, object] = {}
        log.info("Ray placed the ranks: %s", ", ".join(f"rank {r} on {p.ip} ({p.node[:8]})"
                                                       for r, p in enumerate(self.placements)))

    def start(self, specs: dict[int, dict]) -> None:
        for r, spec in specs.items():
            actor = TensorParallelRank.options(
                num_cpus=self.placements[r].threads, name=None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r),
            ).remote()
            self.actors[r] = actor
            self.runs[r] = actor.run.remote(spec)

    def dead(self) -> str | None:
        if not self.runs:
            return None
        done, _ = ray.wait(list(self.runs.values()), num_returns=1, timeout=0)
        for r, ref in self.runs.items():
            if ref in done:
                where = self.placements[r].ip
                try:
                    return f"tensor-parallel rank {r} (Ray actor on {where}) exited with {ray.get(ref)}"
                except ray.exceptions.RayError as e:
                    return f"tensor-parallel rank {r} (Ray actor on {where}) died: {_first_line(e)}"
        return None

    def stop(self, timeout: float = 10) -> None:
        if self.runs:
            ray.wait(list(self.runs.values()), num_returns=len(self.runs), timeout=timeout)
        for actor in self.actors.values():
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone with its node
                pass
        try:
            remove_placement_group(self.pg)
        except Exception:  # noqa: BLE001 - the cluster itself is going away
            pass
        self.actors.clear()
        self.runs.clear()
