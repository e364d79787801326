"""`make_engine`: the one place that picks the runner (`--runner`, vLLM's name) and builds its
engine; everything after it holds an `Engine` (inferd.engine.interface) and never asks which."""
from __future__ import annotations

from inferd.config import EngineConfig
from inferd.engine.engine import LLMEngine
from inferd.engine.interface import Engine
from inferd.engine.pooling import PoolingEngine
from inferd.model import registry


def make_engine(cfg: EngineConfig, loaded=None, **kw) -> Engine:
    """The engine `cfg.runner` asks for: auto pools with an encoder and generates with a decoder."""
    if cfg.runner == "generate" or (cfg.runner == "auto" and cfg.tensor_parallel_size > 1):
        return LLMEngine(cfg, loaded=loaded, **kw)
    if loaded is None:
        from inferd.loading.loader import load_model

        loaded = load_model(cfg.load_config())
    if cfg.runner == "pooling" or registry.by_name(loaded.config.architecture).encoder:
        return PoolingEngine(cfg, loaded)
    return LLMEngine(cfg, loaded=loaded, **kw)
