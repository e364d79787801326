"""OpenAI's API dialect: completions, chat completions and the Responses API."""
from __future__ import annotations

from fastapi import APIRouter

from inferd.server.models import Models
from inferd.server.openai import chat, completions, responses
from inferd.server.openai.store import ResponseStore


def router(models: Models, store: ResponseStore) -> APIRouter:
    r = APIRouter()
    r.include_router(completions.router(models))
    r.include_router(chat.router(models))
    r.include_router(responses.router(models, store))
    return r
