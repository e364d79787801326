"""Ollama's API dialect (`/api/*`: what editors and chat UIs use to find and run local models)."""
from __future__ import annotations

from inferd.server.ollama.api import router

__all__ = ["router"]
