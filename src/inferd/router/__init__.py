"""`inferd router`: spreading requests over OpenAI-compatible servers.

app       the OpenAI-compatible front (`Router`: its routes, and the one way it sends to a backend)
backends  the backends: health, load from their /metrics
disagg    the two-phase flow over prefill and decode workers
main      the command: its arguments, then uvicorn

Where a request goes (round_robin, least_loaded, prefix) is `inferd.distributed.policy`, shared with
`inferd serve --data-parallel-size`.
"""
