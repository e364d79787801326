"""One exception type for every user-facing failure: the CLI prints its message on one line and
exits 2; the server maps it to HTTP 400."""


class InferdError(Exception):
    pass
