"""Every subcommand keeps its flags: name, dest, default, type, choices and nargs of each option,
compared with a snapshot taken before the code behind them was restructured. A flag added on
purpose is added to the snapshot in the same commit (`python tests/test_cli_options.py --write`)."""
import argparse
import json
import os
import sys

SNAPSHOT = os.path.join(os.path.dirname(__file__), "data", "cli_options.json")


def _name(t):
    if t is None:
        return None
    return getattr(t, "__qualname__", None) or type(t).__name__


def options() -> dict:
    from inferd.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out = {}
    for cmd, p in sorted(sub.choices.items()):
        rows = []
        for a in p._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            default = a.default if isinstance(a.default, (str, int, float, bool, list, type(None))) else repr(a.default)
            rows.append({"flags": list(a.option_strings) or [a.dest], "dest": a.dest, "default": default,
                         "type": _name(a.type), "choices": list(a.choices) if a.choices else None,
                         "nargs": a.nargs, "action": type(a).__name__})
        out[cmd] = sorted(rows, key=lambda r: r["dest"])
    return out


def test_every_subcommand_keeps_its_options():
    with open(SNAPSHOT) as f:
        want = json.load(f)
    got = json.loads(json.dumps(options()))
    assert sorted(got) == sorted(want)
    for cmd in want:
        assert got[cmd] == want[cmd], cmd


if __name__ == "__main__" and "--write" in sys.argv:
    with open(SNAPSHOT, "w") as f:
        json.dump(options(), f, indent=1, sort_keys=True)
        f.write("\n")
