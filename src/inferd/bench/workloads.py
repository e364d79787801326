"""Chat workloads for speculative decoding, generated offline from the text shipped here: where
outputs repeat what the engine has seen (and where they do not).

  agent-loop       a coding agent's conversation: a rename to make, `ls -la` and `cat` commands with
                   their output sent back, the file rewritten, a failing test, the file again (turns 2
                   to 4 of each conversation are requests of their own: quote the listing, write the
                   renamed file, write it again fixed)
  code-edit        a source file and a small change to make; the answer is the whole file again
  json-extraction  a paragraph about people; the answer lists them as JSON, values copied
  low-rep-chat     open questions (stories, explanations, advice): little to copy

Every request is a list of chat messages (user and assistant turns alternating, so that every chat
template takes them: tool output travels in user turns), reproducible from (workload, seed, index).
`render` writes one as plain text for a completions endpoint.
"""
from __future__ import annotations

import random
import re

WORKLOADS = ("agent-loop", "code-edit", "json-extraction", "low-rep-chat")

# -- shipped text ---------------------------------------------------------------------------------

CODE = {
    "retry.py": ('''import time


def retry(call, attempts=3, delay=0.5, backoff=2.0):
    """Call `call()` until it succeeds or the attempts run out."""
    last_error = None
    for attempt in range(attempts):
        try:
            return call()
        except Exception as error:
            last_error = error
            if attempt + 1 < attempts:
                time.sleep(delay)
                delay = delay * backoff
    raise last_error


def with_timeout(call, timeout=30):
    started = time.monotonic()
    result = call()
    elapsed = time.monotonic() - started
    if elapsed > timeout:
        print("warning: the call took", elapsed, "seconds")
    return result
''', [("retry", "retry_call"), ("delay", "wait_seconds"), ("last_error", "failure")],
     [("attempts=3", "attempts=5"), ("timeout=30", "timeout=60")]),
    "inventory.py": ('''class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, count=1):
        if count <= 0:
            raise ValueError("count must be positive")
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count=1):
        have = self.items.get(name, 0)
        if count > have:
            raise KeyError(name)
        if count == have:
            del self.items[name]
        else:
            self.items[name] = have - count

    def total(self):
        return sum(self.items.values())

    def report(self):
        lines = []
        for name in sorted(self.items):
            lines.append(f"{name}: {self.items[name]}")
        return "\\n".join(lines)
''', [("Inventory", "Stock"), ("items", "counts"), ("report", "summary")],
     [("count=1):\n        if", "count=1):\n        if name == \"\":\n            raise ValueError(\"empty name\")\n        if")]),
    "stats.py": ('''def mean(values):
    if not values:
        return 0.0
    return sum(values) / len(values)


def median(values):
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        return 0.0
    middle = n // 2
    if n % 2 == 1:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


def variance(values):
    m = mean(values)
    return sum((v - m) ** 2 for v in values) / max(len(values) - 1, 1)


def summary(values):
    return {"mean": mean(values), "median": median(values), "variance": variance(values),
            "count": len(values)}
''', [("values", "numbers"), ("ordered", "sorted_values"), ("summary", "describe")],
     [("max(len(values) - 1, 1)", "max(len(values), 1)")]),
    "config_loader.py": ('''import json
import os

DEFAULTS = {"host": "127.0.0.1", "port": 8080, "workers": 4, "log_level": "info"}


def load_config(path):
    settings = dict(DEFAULTS)
    if os.path.exists(path):
        with open(path) as handle:
            settings.update(json.load(handle))
    for key in DEFAULTS:
        env = os.environ.get("APP_" + key.upper())
        if env is not None:
            settings[key] = type(DEFAULTS[key])(env)
    return settings


def check_config(settings):
    if not 0 < settings["port"] < 65536:
        raise ValueError("port out of range")
    if settings["workers"] < 1:
        raise ValueError("need at least one worker")
    return settings
''', [("settings", "config"), ("load_config", "read_config"), ("handle", "f")],
     [('"port": 8080', '"port": 9000'), ('"workers": 4', '"workers": 8')]),
    "queue_worker.py": ('''import queue
import threading


class Worker:
    def __init__(self, handler, size=100):
        self.handler = handler
        self.tasks = queue.Queue(maxsize=size)
        self.results = []
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.running = False

    def start(self):
        self.running = True
        self.thread.start()

    def submit(self, task):
        self.tasks.put(task)

    def run(self):
        while self.running:
            task = self.tasks.get()
            if task is None:
                break
            self.results.append(self.handler(task))
            self.tasks.task_done()

    def stop(self):
        self.running = False
        self.tasks.put(None)
        self.thread.join()
''', [("Worker", "TaskRunner"), ("tasks", "jobs"), ("handler", "callback")],
     [("size=100", "size=1000")]),
    "text_tools.py": ('''import re

WORD = re.compile(r"[A-Za-z']+")


def words(text):
    return [w.lower() for w in WORD.findall(text)]


def word_counts(text):
    counts = {}
    for w in words(text):
        counts[w] = counts.get(w, 0) + 1
    return counts


def top_words(text, n=10):
    counts = word_counts(text)
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return ranked[:n]


def title_case(text):
    return " ".join(w.capitalize() for w in text.split())
''', [("words", "tokens"), ("counts", "frequency"), ("ranked", "ordered")],
     [("n=10", "n=5")]),
}

NAMES = ["Alice Moreau", "Bruno Silva", "Chen Wei", "Dara Okafor", "Elena Petrova", "Farid Haddad", "Greta Lind",
         "Hiro Tanaka", "Ines Duarte", "Jonas Berg", "Kavya Rao", "Liam O'Brien", "Maya Cohen", "Nils Eriksen",
         "Omar Saleh", "Priya Nair", "Quentin Roy", "Rosa Mendes", "Sam Whitaker", "Tariq Aziz", "Una Kelly",
         "Victor Hugo Lima", "Wen Li", "Yara Nasser", "Zoe Fischer"]
CITIES = ["Lisbon", "Nairobi", "Osaka", "Toronto", "Krakow", "Valparaiso", "Tbilisi", "Adelaide", "Bergen",
          "Marrakesh", "Hanoi", "Cork", "Tucson", "Leipzig", "Pune", "Quito"]
JOBS = ["nurse", "carpenter", "software engineer", "teacher", "baker", "pilot", "architect", "librarian",
        "electrician", "journalist", "chemist", "farmer", "translator", "accountant"]
HOBBIES = ["plays the cello", "runs marathons", "keeps bees", "restores old bicycles", "paints watercolours",
           "collects maps", "grows tomatoes", "builds model ships", "sings in a choir", "climbs mountains"]
DIRS = ["src", "tests", "docs", "scripts", "config", "data", "build", "assets"]
STEMS = ["main", "utils", "parser", "server", "client", "models", "schema", "cache", "router", "worker",
         "settings", "handlers", "metrics", "storage", "auth", "jobs", "report", "loader"]
EXTS = [".py", ".py", ".py", ".json", ".md", ".yaml", ".txt", ".cfg"]
MONTHS = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"]
TOPICS = ["a lighthouse keeper who finds a message in a bottle", "a fox who learns to read", "the first day of a "
          "new school", "a robot that wants to paint", "two friends lost in a market", "a storm over a small "
          "island", "a baker who oversleeps", "a dragon afraid of the dark", "a train that never stops",
          "a garden on the roof of a city"]
CONCEPTS = ["why the sky is blue", "how vaccines work", "what inflation is", "how a bicycle stays upright",
            "why we have seasons", "how bees make honey", "what a black hole is", "how the internet sends "
            "messages", "why bread rises", "how rainbows form", "what gravity does", "how plants drink water"]
ADVICE = ["sleeping better", "learning a new language", "saving money", "starting to run", "keeping a plant alive",
          "preparing for a job interview", "writing a clear email", "cooking for a large group",
          "studying for an exam", "moving to a new city"]


# -- generators -----------------------------------------------------------------------------------

def _listing(rng: random.Random, n: int) -> tuple[str, list[str], list[str]]:
    """`ls -la` output: (text, its lines, the Python files in it)."""
    names = set()
    while len(names) < n:
        if rng.random() < 0.2:
            names.add(rng.choice(DIRS) + "/")
        else:
            names.add(rng.choice(STEMS) + rng.choice(EXTS))
    lines = [f"total {rng.randint(20, 400)}", "drwxr-xr-x  9 dev dev  4096 Mar  3 09:12 .",
             "drwxr-xr-x 14 dev dev  4096 Feb 27 17:40 .."]
    py = []
    for name in sorted(names):
        when = f"{rng.choice(MONTHS)} {rng.randint(1, 28):>2} {rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
        if name.endswith("/"):
            lines.append(f"drwxr-xr-x  {rng.randint(2, 6)} dev dev  4096 {when} {name[:-1]}")
        else:
            lines.append(f"-rw-r--r--  1 dev dev {rng.randint(120, 48000):>5} {when} {name}")
            if name.endswith(".py"):
                py.append(lines[-1])
    return "\n".join(lines), lines, py


def _rename(code: str, old: str, new: str, keep_last: bool = False) -> str:
    """Every whole-word `old` renamed `new` (all but the last one with keep_last: an edit that missed one)."""
    spots = [m.start() for m in re.finditer(rf"\b{re.escape(old)}\b", code)]
    if keep_last:
        spots = spots[:-1]
    for at in reversed(spots):
        code = code[:at] + new + code[at + len(old):]
    return code


def agent_loop(rng: random.Random, turn: int) -> list[dict]:
    """A coding agent's conversation up to the request for its turn-th answer (2..4): it lists the
    repository (turn 2 asks which entries are Python files, quoting the listing), reads a file (turn
    3 asks for the whole file with a rename made), and is told by the tests that its edit missed a
    place (turn 4 asks for the whole file again, fixed). The assistant turns in the history are the
    answers an agent would give, made here from the file."""
    project = rng.choice(["billing-service", "photo-sorter", "weather-bot", "invoice-tool", "chat-relay"])
    listing, lines, py = _listing(rng, rng.randint(14, 22))
    file, (code, renames, _) = rng.choice(sorted(CODE.items()))
    twice = [r for r in renames if len(re.findall(rf"\b{re.escape(r[0])}\b", code)) >= 2] or renames
    old, new = rng.choice(twice)
    msgs = [{"role": "user", "content": (
        f"You are a coding agent in the repository `{project}`. Task: in `{file}`, rename `{old}` to `{new}` "
        "everywhere. Each turn, reply with one shell command in a ```sh block and I will send back its output; "
        "to change a file, write its whole new content in one ```python block. Quote the lines of output you rely "
        "on exactly as they appear.")},
        {"role": "assistant", "content": "Let me look at the repository first.\n```sh\nls -la\n```"},
        {"role": "user", "content": f"Tool output:\n```\n{listing}\n```"}]
    if turn == 2:
        msgs[-1]["content"] += ("\nWhich entries are Python files? Copy their lines from the listing exactly, "
                                "one per line, then give the next command.")
        return msgs
    quoted = "\n".join(py) if py else "(none)"
    msgs += [{"role": "assistant", "content": (f"The Python files in the listing are:\n```\n{quoted}\n```\n"
                                               f"Now I read `{file}`.\n```sh\ncat {file}\n```")},
             {"role": "user", "content": f"Tool output:\n```\n{code}```"}]
    if turn == 3:
        msgs[-1]["content"] += f"\nNow write the whole of `{file}` with `{old}` renamed to `{new}`."
        return msgs
    missed = _rename(code, old, new, keep_last=True)
    msgs[-1]["content"] += f"\nNow write the whole of `{file}` with `{old}` renamed to `{new}`."
    msgs += [{"role": "assistant", "content": f"Here is `{file}` with the rename:\n```python\n{missed}```"},
             {"role": "user", "content": "Tool output:\n```\n$ python -m pytest -q\nF\nE   NameError: name "
                                         f"'{old}' is not defined\n1 failed in 0.04s\n```\nYour edit missed a place. "
                                         f"Write the whole of `{file}` again, with every `{old}` renamed."}]
    return msgs


def code_edit(rng: random.Random) -> list[dict]:
    file, (code, renames, changes) = rng.choice(sorted(CODE.items()))
    if changes and rng.random() < 0.35:
        old, new = rng.choice(changes)
        ask = f"Change `{old.splitlines()[0]}` so that it reads `{new.splitlines()[0]}`" if "\n" not in old else \
            "Make `add` refuse an empty name with a ValueError"
    else:
        old, new = rng.choice(renames)
        ask = f"Rename `{old}` to `{new}` everywhere"
    return [{"role": "user", "content": f"Here is `{file}`:\n```python\n{code}```\n{ask}. Reply with the whole "
                                        "updated file in one ```python block and nothing else."}]


def json_extraction(rng: random.Random) -> list[dict]:
    people = rng.sample(NAMES, rng.randint(3, 5))
    parts, want = [], []
    for name in people:
        age, city, job = rng.randint(19, 78), rng.choice(CITIES), rng.choice(JOBS)
        hobby = rng.choice(HOBBIES)
        parts.append(rng.choice([
            f"{name} is a {age}-year-old {job} from {city} who {hobby}.",
            f"Born in {city}, {name} ({age}) works as a {job} and {hobby}.",
            f"{name}, {age}, lives in {city}; a {job} by trade, {name.split()[0]} also {hobby}."]))
        want.append(name)
    text = " ".join(parts)
    return [{"role": "user", "content": "Extract every person mentioned in the text as a JSON list of objects with "
                                        "the keys \"name\", \"age\", \"city\", \"occupation\" and \"hobby\". Copy the "
                                        f"values exactly as written in the text.\n\nText: {text}\n\nJSON:"}]


def low_rep_chat(rng: random.Random) -> list[dict]:
    kind = rng.randrange(3)
    if kind == 0:
        ask = f"Write a short story about {rng.choice(TOPICS)}."
    elif kind == 1:
        ask = f"Explain {rng.choice(CONCEPTS)} in simple words."
    else:
        ask = f"Give me some advice on {rng.choice(ADVICE)}."
    return [{"role": "user", "content": ask}]


def conversations(workload: str, num: int, seed: int = 0) -> list[list[dict]]:
    """`num` requests of a workload, each its chat messages; the same for the same seed."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r} ({', '.join(WORKLOADS)})")
    out = []
    for i in range(num):
        if workload == "agent-loop":  # turns 2, 3, 4 of conversation i // 3
            rng = random.Random(f"{workload}:{seed}:{i // 3}")
            out.append(agent_loop(rng, 2 + i % 3))
            continue
        rng = random.Random(f"{workload}:{seed}:{i}")
        out.append({"code-edit": code_edit, "json-extraction": json_extraction, "low-rep-chat": low_rep_chat}
                   [workload](rng))
    return out


def render(messages: list[dict]) -> str:
    """A conversation as plain text (a completions endpoint's prompt)."""
    names = {"user": "User", "assistant": "Assistant", "system": "System"}
    return "".join(f"{names.get(m['role'], m['role'])}: {m['content']}\n\n" for m in messages) + "Assistant:"
