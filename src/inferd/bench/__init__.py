"""`inferd bench`: a load generator for any OpenAI-compatible endpoint.

datasets -> arrivals (absolute send times) -> runner (streaming client, every SSE event timed)
-> trace (JSONL) -> metrics (pure functions) -> report (console, JSON, CSV, SLA).
`mock_server` is the calibration endpoint with a known token schedule. Nothing here imports torch
or the engine.
"""
