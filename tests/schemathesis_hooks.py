"""schemathesis hooks for the hardening module's run (loaded through SCHEMATHESIS_HOOKS)."""
import schemathesis


@schemathesis.hook
def map_case(context, case):
    """Ollama's keep_alive unloads the served model when its time runs out (0: at once): a fuzzed
    one would reload the model over and over, and the reloads, not the requests, would fill the run.
    It is tested in test_dialects.py; here it is left out of every body."""
    if isinstance(case.body, dict):
        case.body.pop("keep_alive", None)
    return case
