"""inferd: an LLM inference engine and serving benchmark."""

__version__ = "0.1.0"
