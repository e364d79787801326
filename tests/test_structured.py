"""Structured output and tool calling (inferd.engine.structured, inferd.server.tools) with the real
default model: JSON schemas validated by `jsonschema`, regex / choice / grammar outputs matched,
tool calls through the official `openai` client, a mixed batch with preemption and speculation
against the same requests run alone, and bad constraints as 400s."""
import asyncio
import json
import random
import re

import httpx
import jsonschema
import pytest

from conftest import ServerProc
from helpers import LOGPROB_ATOL, assert_logprobs_close
from json_schemas import SCHEMAS

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}  # no parameters
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(default_gguf_path):
    srv = ServerProc(["--model", default_gguf_path, "--served-model-name", MODEL, "--max-model-len", "1024"])
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)


def post(server, path, body):
    return httpx.post(server.base + path, json=body, timeout=120)


# -- 1. JSON schemas --------------------------------------------------------------------------------

def test_json_schemas_parse_and_validate(server):
    """Every schema of the collection at temperature 0 and at 1 (every other one streamed): >= 90 %
    end with "stop", and every one of those parses and validates."""
    import openai

    client = openai.AsyncOpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)
    assert len(SCHEMAS) >= 50

    async def one(prompt, schema, temperature, stream):
        kw = dict(model=MODEL, messages=[{"role": "user", "content": prompt + " Answer in JSON."}],
                  temperature=temperature, max_tokens=80, seed=7,
                  response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                                          "strict": True}})
        if not stream:
            r = await client.chat.completions.create(**kw)
            return r.choices[0].message.content, r.choices[0].finish_reason
        text, reason = "", None
        async for ch in await client.chat.completions.create(stream=True, **kw):
            if ch.choices:
                text += ch.choices[0].delta.content or ""
                reason = ch.choices[0].finish_reason or reason
        return text, reason

    async def run():
        combos = [(p, s, t, (i + k) % 2 == 1) for i, (p, s) in enumerate(SCHEMAS) for k, t in enumerate((0.0, 1.0))]
        return combos, await asyncio.gather(*[one(*c) for c in combos])

    combos, results = asyncio.run(run())
    for t in (0.0, 1.0):
        for st in (False, True):
            mine = [(c, r) for c, r in zip(combos, results) if c[2] == t and c[3] == st]
            stopped = [(c, r) for c, r in mine if r[1] == "stop"]
            assert len(stopped) >= 0.9 * len(mine), f"temperature {t}, stream {st}: {len(stopped)}/{len(mine)} stop"
            for (prompt, schema, _, _), (text, _) in stopped:
                jsonschema.validate(json.loads(text), schema)  # raises, naming the prompt's schema, if not


def test_json_object_and_schema_on_completions(client):
    r = client.completions.create(model=MODEL, prompt="The cat as JSON, with its name and age:", max_tokens=64,
                                  temperature=0, extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].text), dict)
    schema = SCHEMAS[0][1]
    r = client.completions.create(model=MODEL, prompt="A person:", max_tokens=64, temperature=1.0, n=3, seed=3,
                                  extra_body={"structured_outputs": {"json": schema}})
    for ch in r.choices:
        assert ch.finish_reason == "stop"
        jsonschema.validate(json.loads(ch.text), schema)


# -- 2. regex, choice, grammars ---------------------------------------------------------------------

@pytest.mark.parametrize("constraint,check", [
    ({"regex": r"[A-Z][a-z]{2,8} [0-9]{1,3}"}, lambda s: re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{1,3}", s)),
    ({"choice": ["positive", "negative", "neutral"]}, lambda s: s in ("positive", "negative", "neutral")),
    ({"grammar": 'start: greeting " " name "!"\ngreeting: "Hello" | "Hi"\nname: /[A-Z][a-z]{1,10}/'},
     lambda s: re.fullmatch(r"(Hello|Hi) [A-Z][a-z]{1,10}!", s)),
    ({"grammar": 'root ::= "(" digits ("+" digits)* ")"\ndigits ::= [0-9]+'},  # GBNF, as llama.cpp takes it
     lambda s: re.fullmatch(r"\([0-9]+(\+[0-9]+)*\)", s)),
])
def test_regex_choice_and_grammars_match(client, constraint, check):
    outs = []
    for temperature, n in ((0.0, 1), (1.0, 4)):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Answer briefly."}],
                                           max_tokens=40, temperature=temperature, n=n, seed=11,
                                           extra_body={"structured_outputs": constraint})
        outs += [(c.message.content, c.finish_reason) for c in r.choices]
    for text, reason in outs:
        if reason == "stop":
            assert check(text), (constraint, text)
    assert sum(reason == "stop" for _, reason in outs) >= 4, outs


def test_guided_aliases_and_stop_strings(client):
    r = client.completions.create(model=MODEL, prompt="Colours:", max_tokens=8, temperature=0,
                                  extra_body={"guided_choice": ["red", "green", "blue"]})
    assert r.choices[0].text in ("red", "green", "blue")
    # a stop string inside a constrained output ends it there, as without the constraint
    r = client.completions.create(model=MODEL, prompt="Words:", max_tokens=30, temperature=0, stop=[" "],
                                  extra_body={"structured_outputs": {"regex": "[a-z]+ [a-z]+ [a-z]+"}})
    assert r.choices[0].finish_reason == "stop" and re.fullmatch("[a-z]+", r.choices[0].text)


# -- 3. tools ---------------------------------------------------------------------------------------

def _streamed_calls(client, **kw):
    calls, deltas, reason, content = {}, {}, None, ""
    for ch in client.chat.completions.create(stream=True, **kw):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or ():
            if tc.id is not None:  # the first delta of a call: index, id, type, name, empty arguments
                assert tc.type == "function" and tc.function.name and tc.function.arguments == ""
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                deltas[tc.index] = 0
            else:
                assert tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments
                deltas[tc.index] += 1
        reason = ch.choices[0].finish_reason or reason
    return [calls[i] for i in sorted(calls)], deltas, reason, content


@pytest.mark.parametrize("tool_choice,reason", [
    ("required", "tool_calls"),
    ({"type": "function", "function": {"name": "get_weather"}}, "stop"),  # as OpenAI ends a forced call
])
def test_tool_calls_validate_and_stream_in_fragments(client, tool_choice, reason):
    kw = dict(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, CLOCK], tool_choice=tool_choice, temperature=0,
              max_tokens=120)
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == reason and msg.content is None and msg.tool_calls
    schemas = {"get_weather": WEATHER["function"]["parameters"], "get_time": {"type": "object", "maxProperties": 0}}
    for call in msg.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    if isinstance(tool_choice, dict):
        assert [c.function.name for c in msg.tool_calls] == ["get_weather"]
    calls, deltas, sreason, content = _streamed_calls(client, **kw)
    assert sreason == reason and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments)
                                                             for c in msg.tool_calls]
    weather = [i for i, c in enumerate(calls) if c["name"] == "get_weather"]
    assert weather and all(deltas[i] >= 2 for i in weather), deltas


def test_tool_history_renders_and_completes(client):
    history = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=24, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.content
    # tool_choice "none": the tools are shown, no call is read
    r = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="none",
                                       max_tokens=8, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


def test_call_streams_fold_whatever_the_chunking():
    """The tool-call readers give the same calls however the text is cut into deltas."""
    from inferd.server.tools import HermesCalls, RequiredCalls

    def run(reader, text, rng):
        out, i = [], 0
        while i < len(text):
            j = i + rng.randint(1, 6)
            out += reader.feed(text[i:j])
            i = j
        out += reader.finish()
        content = "".join(d.get("content", "") for d in out)
        calls = {}
        for d in out:
            for tc in d.get("tool_calls", ()):
                c = calls.setdefault(tc["index"], {"name": None, "arguments": ""})
                c["name"] = tc["function"].get("name") or c["name"]
                c["arguments"] += tc["function"].get("arguments", "")
        return content, [calls[i] for i in sorted(calls)]

    req = '[{"name":"f","arguments":{"a":"x,}]\\"y","b":[1,{"c":2}]}},{"name":"g","arguments":{}}]'
    hermes = ('Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
              '<tool_call>{"name": "g", "arguments": {}}</tool_call> <tool_call>not json</tool_call> <tool')
    for seed in range(20):
        rng = random.Random(seed)
        assert run(RequiredCalls(), req, rng) == ("", [{"name": "f", "arguments": '{"a":"x,}]\\"y","b":[1,{"c":2}]}'},
                                                       {"name": "g", "arguments": "{}"}])
        content, calls = run(HermesCalls(), hermes, rng)
        assert calls == [{"name": "f", "arguments": '{"a": 1}'}, {"name": "g", "arguments": "{}"}]
        assert content.startswith("Sure.") and "<tool_call>not json</tool_call>" in content and content.endswith("<tool")


# -- 6. bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("extra,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     None, "invalid JSON schema"),
    ({"structured_outputs": {"regex": "a(b"}}, None, "invalid regular expression"),
    ({"structured_outputs": {"grammar": "start: foo"}}, None, "invalid grammar"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", None),
    ({"response_format": {"type": "xml"}}, "response_format.type", None),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag", None),
    ({"functions": [{"name": "f"}]}, "functions", "not supported"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "not supported"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_constraints_are_400(server, extra, param, words, stream):
    r = post(server, "/v1/chat/completions", {"messages": ASK_WEATHER, "max_tokens": 4, "stream": stream, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "\n" not in err["message"]
    assert (err["param"] or "").startswith(param or "") and (param is not None or err["param"] is None)
    if words:
        assert words in err["message"], err
    assert httpx.get(server.base + "/health", timeout=10).status_code == 200


# -- 4. the engine: a mixed batch, preemption, n, logprobs, speculation ------------------------------

CONSTRAINTS = [{"json": s} for _, s in SCHEMAS[:10]] + [
    {"regex": r"[0-9]{3}-[0-9]{4}"}, {"choice": ["alpha", "beta", "gamma"]}, {"json_object": True},
    {"grammar": 'start: "x" /[a-c]{1,5}/ "y"'}, {"regex": r"(yes|no), because [a-z ]{1,20}\."}, {"json": SCHEMAS[20][1]},
]
QUESTIONS = ["Tell me about the sea.", "What is a cat?", "Name a colour.", "Why is the sky blue?",
             "Write a haiku.", "What is 2 + 2?", "Describe Paris.", "Give me a number."]


def _matches(c: dict, text: str) -> bool:
    (kind, v), = c.items()
    if kind == "json":
        jsonschema.validate(json.loads(text), v)
        return True
    if kind == "json_object":
        return isinstance(json.loads(text), dict)
    if kind == "regex":
        return re.fullmatch(v, text) is not None
    if kind == "choice":
        return text in v
    return re.fullmatch("x[a-c]{1,5}y", text) is not None


def _same(got, ref, label):
    """Greedy fp32 outputs equal, or equal up to a position where the two runs' choices are within
    LOGPROB_ATOL in logprob (a near tie that a different summation order may flip)."""
    a, b = got.token_ids, ref.token_ids
    if a == b:
        return 0
    k = next(i for i in range(min(len(a), len(b)) + 1) if i == min(len(a), len(b)) or a[i] != b[i])
    assert k < min(len(a), len(b)), f"{label}: one output is a prefix of the other"
    assert abs(got.logprobs[k][0] - ref.logprobs[k][0]) <= LOGPROB_ATOL, f"{label}: {got.text!r} vs {ref.text!r}"
    return 1


@pytest.fixture(scope="module")
def prompts(default_gguf_path):
    from inferd.tokenizer import Tokenizer

    tok = Tokenizer.load(default_gguf_path)
    return [tok.apply_chat_template([{"role": "user", "content": q + " Answer in the format asked."}], tokenize=True)
            for q in QUESTIONS * 2]


def _params(c):
    from inferd.engine.request import SamplingParams, StructuredOutputs

    # unconstrained rows need not finish (12 tokens); constrained ones get room to
    return SamplingParams(max_tokens=24 if c else 12, temperature=0, logprobs=0,
                          structured_outputs=StructuredOutputs(**c) if c else None)


def test_mixed_batch_preemption_and_speculation(prompts, default_gguf_path):
    """32 requests at once, 16 constrained and 16 not, in a KV pool too small for all (preemption):
    each unconstrained output equals the same request run alone (greedy fp32), the constrained ones
    are valid, their masks were computed during the forward; with n-gram speculation every output
    is the same again."""
    from inferd.engine.llm import LLM

    cons = CONSTRAINTS[:16]
    work = [(prompts[i], cons[i]) for i in range(16)] + [(prompts[i], None) for i in range(16)]
    random.Random(0).shuffle(work)
    params = [_params(c) for _, c in work]
    base = dict(model=default_gguf_path, quantization="none", dtype="float32", max_model_len=512, num_kv_blocks=40)
    with LLM(**base) as llm:
        alone = {i: llm.generate(p, sp)[0] for i, ((p, c), sp) in enumerate(zip(work, params)) if c is None}
        eng = llm.engine
        eng.grammars()
        eng.structured.overlap = True  # masks on the thread during the forward (the default on GPUs)
        batch = llm.generate([p for p, _ in work], params)
        assert eng.stats.preemptions > 0, "the pool was meant to force preemption"
        assert eng.stats.max_batch_seqs >= 16 and eng.stats.max_mixed_batch_seqs > 1
        assert eng.structured.ahead > 0 and eng.block_manager.num_used == 0
    with LLM(**base, speculative_method="ngram", num_speculative_tokens=3) as llm:
        llm.engine.grammars()
        llm.engine.structured.overlap = False  # ... and after it, on the engine thread (a CPU's choice for one row)
        spec = llm.generate([p for p, _ in work], params)
        st = llm.engine.spec.stats
        assert st.num_draft_tokens > 0 and 0 < st.num_accepted_tokens < st.num_draft_tokens
        assert llm.engine.structured.inline > 0 and llm.engine.structured.ahead == 0
    near = 0
    for i, ((_, c), b, s) in enumerate(zip(work, batch, spec)):
        near += _same(s, b, f"speculation #{i}")
        if c is None:
            near += _same(b, alone[i], f"batch #{i}")
        elif b.finish_reason == "stop":
            assert _matches(c, b.text), (c, b.text)
    assert sum(b.finish_reason == "stop" for (_, c), b in zip(work, batch) if c) >= 8
    assert near <= 4


def test_constraint_logprobs_are_raw_and_n_samples_valid(prompts, default_gguf_path):
    from inferd.engine.llm import LLM
    from inferd.engine.request import SamplingParams, StructuredOutputs
    from inferd.errors import InferdError

    with LLM(model=default_gguf_path, quantization="none", dtype="float32", max_model_len=512) as llm:
        free = llm.generate(prompts[0], SamplingParams(max_tokens=1, temperature=0, logprobs=5))[0]
        so = StructuredOutputs(choice=["alpha", "beta"])
        held = llm.generate(prompts[0], SamplingParams(max_tokens=4, temperature=0, logprobs=5,
                                                       structured_outputs=so))[0]
        assert held.text in ("alpha", "beta")
        # the first position's alternatives are the model's own (before the mask), as vLLM reports
        # them; the second run hits the prefix cache, so its sums run in another shape
        assert_logprobs_close(held.logprobs[0][2], free.logprobs[0][2], "first position's alternatives")
        out = llm.generate(prompts[1], SamplingParams(max_tokens=40, temperature=1.0, n=4, seed=5,
                                                      structured_outputs=StructuredOutputs(json=SCHEMAS[1][1])))[0]
        assert len(out.samples) == 4
        for s in out.samples:
            if s.finish_reason == "stop":
                jsonschema.validate(json.loads(s.text), SCHEMAS[1][1])
        with pytest.raises(InferdError, match="invalid JSON schema"):
            llm.engine.add_request(prompts[0], SamplingParams(structured_outputs=StructuredOutputs(json={"type": 3})))
        assert not llm.engine.has_unfinished() and llm.engine.block_manager.num_used == 0
