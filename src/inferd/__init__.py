"""inferd: an LLM inference engine and serving benchmark."""

__version__ = "0.1.0"

__all__ = ["LLM", "LLMEngine", "SamplingParams", "EngineConfig"]


def __getattr__(name):  # lazy: `import inferd` stays cheap for the CLI and the bench client
    if name == "LLM":
        from inferd.engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from inferd.engine.engine import LLMEngine

        return LLMEngine
    if name == "SamplingParams":
        from inferd.engine.request import SamplingParams

        return SamplingParams
    if name == "EngineConfig":
        from inferd.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)
