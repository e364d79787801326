"""Replicas: spreading requests over engines or servers.

policy    where a request goes (round_robin, least_loaded, prefix); shared with
          `inferd serve --data-parallel-size`
backends  the router's backends: health, load from their /metrics
app       `inferd router`: the OpenAI-compatible front
"""
