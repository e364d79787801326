"""Anthropic's API dialect: the Messages API (what Claude Code and Anthropic's SDKs speak)."""
from __future__ import annotations

from inferd.server.anthropic.messages import router

__all__ = ["router"]
