"""Structured output and tools without a real model: grammars compiled and refused, masks
that hold in the engine (batched with free requests, sampled and greedy, cut by
max_tokens), penalties, and the API's response_format, tools and streamed tool calls."""

from __future__ import annotations

import json
import re

import pytest
import torch
from fastapi.testclient import TestClient

from hyla.data.tokenizer import ByteTokenizer
from hyla.model import HylaLM, preset
from hyla.serve.api.app import create_app
from hyla.serve.api.schemas import APIError
from hyla.serve.api.tools import ToolStream, chat_messages, parse_tools, split_calls
from hyla.serve.async_engine import AsyncEngine
from hyla.serve.engine import Engine, EngineConfig
from hyla.serve.json_schema import has_finite_instance
from hyla.serve.penalties import apply_penalties
from hyla.serve.sequence import GrammarSpec, SamplingParams
from hyla.serve.structured import GrammarCompiler

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return HylaLM(preset("debug")).eval()


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(ByteTokenizer(), vocab_size=256, stop_ids=[0])


@pytest.mark.parametrize("spec, needle", [
    (GrammarSpec("json_schema", "{not json"), "not valid JSON"),
    (GrammarSpec("json_schema", "[1, 2]"), "must be a JSON object"),
    (GrammarSpec("json_schema", '{"type": "bogus"}'), "Invalid type"),
    (GrammarSpec("json_schema", '{"type": "integer", "minimum": 5, "maximum": 1}'),
     "nsatisfiable"),
    (GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {
        "a": {"$ref": "#"}}, "required": ["a"]})), "recursive without a base case"),
    (GrammarSpec("regex", "[0-9"), "regular expression is invalid"),
    (GrammarSpec("grammar", 'root ::= "a" ('), "grammar is invalid"),
    (GrammarSpec("choice", "[]"), "invalid"),
])
def test_bad_grammars_are_named(compiler, spec, needle):
    with pytest.raises(ValueError, match=needle):
        compiler.compile(spec)


def test_grammar_specs_refuse_bad_fields():
    with pytest.raises(ValueError, match="kind"):
        GrammarSpec("yaml", "x")
    with pytest.raises(ValueError, match="too large"):
        GrammarSpec("regex", "a" * ((1 << 20) + 1))
    with pytest.raises(ValueError, match="grammar must be a GrammarSpec"):
        SamplingParams(grammar="[0-9]+")
    with pytest.raises(ValueError, match="frequency_penalty"):
        SamplingParams(frequency_penalty=float("nan"))


def test_finite_instance_follows_refs_through_optional_and_required_paths():
    linked = {"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}},
                              "required": ["b"]},
                        "b": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/a"}]}},
              "$ref": "#/$defs/a"}
    assert has_finite_instance(linked)
    linked["$defs"]["b"] = {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/a"}}
    assert not has_finite_instance(linked)


def _engine(model, **cfg):
    return Engine(model, ByteTokenizer(), EngineConfig(max_model_len=256, **cfg))


def test_outputs_match_their_grammar_greedy_sampled_and_batched(model):
    regex = GrammarSpec("regex", "(yes|no), [a-z]{2,5}!")
    schema = {"type": "object", "properties": {
        "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"enum": ["red", "blue"]}}, "required": ["ok", "n", "tag"]}
    js = GrammarSpec("json_schema", json.dumps(schema))
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = _engine(model).generate([[5, 6, 7]], free)[0].output_ids
    eng = _engine(model, max_num_seqs=8)
    params = [SamplingParams(max_tokens=60, temperature=t, seed=s, grammar=g)
              for g in (regex, js) for t, s in ((0, None), (1.0, 1), (1.5, 2))] + [free]
    seqs = eng.generate([[1, 2, 3]] * 6 + [[5, 6, 7]], params)
    for seq in seqs[:3]:
        assert re.fullmatch(regex.source, bytes(seq.output_ids).decode().rstrip("\0"))
        assert seq.finish_reason == "stop"
    for seq in seqs[3:6]:
        value = json.loads(bytes(t for t in seq.output_ids if t).decode())
        assert set(value) == {"ok", "n", "tag"} and value["tag"] in ("red", "blue")
    assert seqs[6].output_ids == alone          # a free request beside them is unchanged
    assert not eng.constraints.matchers         # every matcher let go


def test_max_tokens_cuts_a_grammar_with_length(model):
    eng = _engine(model)
    (seq,) = eng.generate([[1]], SamplingParams(max_tokens=3, temperature=0, grammar=GrammarSpec(
        "json_schema", '{"type": "object", "properties": {"name": {"type": "string"}}, '
                       '"required": ["name"]}')))
    assert seq.finish_reason == "length" and len(seq.output_ids) == 3
    with pytest.raises(json.JSONDecodeError):
        json.loads(bytes(seq.output_ids).decode())


def test_token_only_engine_refuses_grammars(model):
    eng = Engine(model, None, EngineConfig(max_model_len=64))
    with pytest.raises(ValueError, match="needs a tokenizer"):
        eng.add_request([1], SamplingParams(grammar=GrammarSpec("regex", "a")))


def test_penalties_lower_repeated_tokens():
    logits = torch.zeros(2, 6)
    p = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
         SamplingParams(repetition_penalty=2.0)]
    logits[1] = torch.tensor([2.0, -2.0, 2.0, 0, 0, 0])
    apply_penalties(logits, p, [[], [0, 1]], [[3, 3, 4], []])
    assert logits[0].tolist() == [0, 0, 0, -1.0, -0.75, 0]
    assert logits[1].tolist() == [1.0, -4.0, 2.0, 0, 0, 0]


def test_parse_tools_refuses_what_it_cannot_serve():
    dup = [WEATHER, WEATHER]
    cases = [(dup, None, "given twice"),
             ([{"type": "function", "function": {"name": "bad name"}}], None, "letters"),
             ([{"type": "function", "function": {"name": "f", "parameters": {
                 "type": "array"}}}], None, "object"),
             ([{"type": "function", "function": {"name": "f", "parameters": {
                 "type": "object", "properties": {"a": {"$ref": "#"}},
                 "required": ["a"]}}}], None, "recursive"),
             ([{"type": "retrieval"}], None, "must be"),
             ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "names no tool"),
             ([WEATHER], "sometimes", "tool_choice must be"),
             (None, "required", "needs tools")]
    for tools, choice, needle in cases:
        with pytest.raises(APIError, match=needle):
            parse_tools(tools, choice, None)
    assert parse_tools([WEATHER], "none", None) is None
    assert parse_tools([WEATHER], None, False).choice == "auto"


def test_tool_calls_split_and_stream_at_every_cut():
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
            '"Oslo"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call>')
    content, calls = split_calls(text)
    assert content == "Let me look." and [json.loads(c["function"]["arguments"])["city"]
                                          for c in calls] == ["Oslo", "Paris"]
    for cut in range(1, len(text)):
        s = ToolStream()
        events = s.feed(text[:cut]) + s.feed(text[cut:])
        said = "".join(v for k, v in events if k == "content") + s.flush()
        assert said.strip() == "Let me look." and [v for k, v in events if k == "call"] == [
            "get_weather", "get_weather"]
    s = ToolStream()
    assert s.feed("<tool_call>\n{broken") == [] and s.flush() == "<tool_call>\n{broken"


def test_no_newline_after_a_streamed_call_becomes_content():
    """The newline after a call's closing tag, arriving in the next piece, was streamed as
    content ("\n") where the whole response has none (the re-test's)."""
    s = ToolStream()
    events = s.feed('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>')
    events += s.feed("\n") + s.feed("\n")
    assert [k for k, _ in events] == ["call"] and s.flush() == ""
    assert s.feed("\nthen text") == [("content", "then text")]


def test_a_tool_argument_may_hold_the_closing_tag():
    """An argument whose text holds ``</tool_call>`` (code, or injected text) is part of
    the call; the tag ends the block only outside JSON strings (found by a hostile client:
    the call was cut there, and came back as content with finish_reason "stop")."""
    text = ('<tool_call>\n{"name": "f", "arguments": {"a": "</tool_call>", "b": '
            '"x\\"</tool_call>"}}\n</tool_call> after')
    content, calls = split_calls(text)
    assert content == "after" and json.loads(calls[0]["function"]["arguments"]) == {
        "a": "</tool_call>", "b": 'x"</tool_call>'}
    for cut in range(1, len(text)):
        s = ToolStream()
        events = s.feed(text[:cut]) + s.feed(text[cut:])
        said = "".join(v for k, v in events if k == "content") + s.flush()
        assert [k for k, _ in events][0] == "call" and said.strip() == "after"
        assert [k for k, _ in events].count("call") == 1
        assert json.loads(s.calls[0]["function"]["arguments"])["a"] == "</tool_call>"
    # a block that is not a call stays text, and the calls after it are found
    content, calls = split_calls('<tool_call>oops</tool_call> <tool_call>{"name": "g"}'
                                 '</tool_call>')
    assert content == "<tool_call>oops</tool_call>" and calls[0]["function"]["name"] == "g"


def test_templates_without_tools_get_them_as_text():
    from hyla.serve.api.schemas import ChatMessage

    msgs = [ChatMessage(role="user", content="weather?"),
            ChatMessage(role="assistant", content=None, tool_calls=[{
                "id": "c1", "function": {"name": "get_weather",
                                         "arguments": '{"city": "Oslo"}'}}]),
            ChatMessage(role="tool", content="12 C", tool_call_id="c1")]
    out, extra = chat_messages(msgs, parse_tools([WEATHER], None, None), template=None)
    assert extra == {} and out[0]["role"] == "system" and "get_weather" in out[0]["content"]
    assert '"arguments": {"city": "Oslo"}' in out[2]["content"]
    assert out[3] == {"role": "user", "content": "<tool_response>\n12 C\n</tool_response>"}
    native, extra = chat_messages(msgs, parse_tools([WEATHER], None, None),
                                  template="{% for t in tools %}{% endfor %}")
    assert extra["tools"] == [WEATHER] and native[1]["tool_calls"][0]["function"][
        "arguments"] == {"city": "Oslo"} and native[2]["tool_call_id"] == "c1"


@pytest.fixture(scope="module")
def client(model):
    eng = AsyncEngine(Engine(model, ByteTokenizer(), EngineConfig(max_model_len=1024,
                                                                  max_num_seqs=4)))
    yield TestClient(create_app(eng, model_name="m"))
    eng.shutdown()


def _chat(client, **body):
    # json.dumps writes NaN and Infinity as Python's json (and so the server) reads them
    return client.post("/v1/chat/completions", headers={"Content-Type": "application/json"},
                       content=json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                           "max_tokens": 80, **body}))


def test_api_response_format_and_extensions(client):
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]}
    r = _chat(client, response_format={"type": "json_schema", "json_schema": {
        "name": "s", "schema": schema, "strict": True}}, temperature=0).json()
    assert json.loads(r["choices"][0]["message"]["content"])["a"] in ("x", "y")
    r = client.post("/v1/completions", json={"prompt": "q", "max_tokens": 20, "temperature": 1,
                                             "structured_outputs": {"choice": ["cat", "dog"]}})
    assert r.json()["choices"][0]["text"] in ("cat", "dog")
    r = _chat(client, guided_regex="[0-9]{3}", temperature=0).json()
    assert re.fullmatch("[0-9]{3}", r["choices"][0]["message"]["content"])
    for seed in range(4):       # open-ended: the end token (byte 0 here) is not text
        r = _chat(client, guided_regex="[a-c]{2,6}", temperature=1.0, seed=seed).json()
        assert re.fullmatch("[a-c]{2,6}", r["choices"][0]["message"]["content"]), r


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "nope"}}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#"}},
                      "required": ["a"]}}, "guided_json"),
    ({"structured_outputs": {"regex": "(", "choice": ["a"]}}, "structured_outputs"),
    ({"guided_grammar": "x" * 70_000}, "guided_grammar"),
    ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_api_refuses_bad_structured_requests(client, body, param):
    r = _chat(client, **body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_api_tool_calls_whole_and_streamed(client):
    r = _chat(client, tools=[WEATHER], tool_choice="required", temperature=0,
              max_tokens=120).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    call = choice["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Oslo")
    events = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 120, "stream": True,
        "temperature": 0, "tools": [WEATHER], "tool_choice": {
            "type": "function", "function": {"name": "get_weather"}}}).text
    chunks = [json.loads(e[6:]) for e in events.split("\n\n") if e.startswith("data: {")]
    deltas = [c["choices"][0]["delta"].get("tool_calls") for c in chunks]
    streamed = [d[0] for d in deltas if d]
    assert streamed[0]["function"]["name"] == "get_weather" and streamed[0]["id"]
    args = "".join(d["function"]["arguments"] for d in streamed)
    assert json.loads(args) == json.loads(call["function"]["arguments"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_chat_json_schema_python_api_and_cli(tmp_path, capsys):
    from hyla.cli.chat import Conversation
    from hyla.cli.main import main

    schema = {"type": "object", "properties": {"v": {"enum": ["a", "b"]},
                                               "n": {"type": "integer", "maximum": 9,
                                                     "minimum": 0}}, "required": ["v", "n"]}
    torch.manual_seed(1)
    chat = Conversation(HylaLM(preset("debug")).eval(), ByteTokenizer(), max_tokens=60,
                        temperature=1.0, json_schema=schema)
    for turn in ("hi", "again"):
        reply = "".join(chat.reply(turn)).rstrip("\0")
        assert set(json.loads(reply)) == {"v", "n"}
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}')
    assert main(["chat", "--preset", "debug", "--json-schema", str(bad)]) == 2
    assert "recursive without a base case" in capsys.readouterr().err
    assert main(["chat", "--preset", "debug", "--json-schema", "/dev/zero"]) == 2   # unbounded
    assert "larger than" in capsys.readouterr().err
    # checked before the model loads (it once failed after, when the user had typed): a
    # checkpoint that does not exist is never reached
    bad.write_text('{"type": 12}')
    assert main(["chat", "--checkpoint", str(tmp_path / "none"), "--json-schema",
                 str(bad)]) == 2
    assert "type must be a string" in capsys.readouterr().err
    bad.write_bytes(b"\xef\xbb\xbf" + json.dumps(schema).encode())     # a BOM: fine
    from hyla.cli.chat import read_schema
    assert read_schema(str(bad)) == schema


@pytest.mark.parametrize("body, param, needle", [
    ({"guided_choice": [f"c{i}" for i in range(1500)]}, "guided_choice", "too long"),
    ({"guided_regex": "(a{1000}){1000}"}, "grammar", "too many expressions"),
    ({"guided_grammar": 'root ::= "a" root'}, "grammar", "Too many items"),
    ({"guided_json": {"properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]}},
     "guided_json", "recursive"),
    ({"guided_json": "[" * 1000 + "]" * 1000}, "guided_json", "nested too deeply"),
    ({"guided_json": True}, "guided_json", "must be a JSON object"),
    # 1e400 arrives as Infinity (Python's json takes both): it once gave null, out of enum
    ({"guided_json": {"enum": [float("inf")]}}, "guided_json", "a JSON number is finite"),
    ({"guided_json": {"type": "number", "maximum": float("nan")}}, "guided_json", "NaN"),
    ({"repetition_penalty": 1e-300}, "repetition_penalty", "repetition_penalty"),
    ({"tools": [{"type": "function", "function": {"name": "abc\n"}}]},
     "tools.0.function.name", "letters"),
    ({"tools": [{"type": "function", "function": {"name": f"t{i}", "parameters": {
        "type": "object", "properties": {f"p{j}": {"type": "string", "description": "x" * 40}
                                         for j in range(300)}}}} for i in range(12)]},
     "messages", "maximum context length"),      # their grammar builds (a 500 before)
])
def test_api_hostile_structured_requests_are_400s(client, body, param, needle):
    """What a hostile client found (each was a 500, a 503 or a wrong 200 before)."""
    r = _chat(client, **body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert needle in r.json()["error"]["message"], r.text


def test_api_tools_with_nested_defs_and_logprobs_without_masked_tokens(client):
    """A Pydantic model's tool (nested models as $defs/$ref) works; top_logprobs under a
    grammar list no ruled-out token."""
    person = {"$defs": {"Addr": {"type": "object", "properties": {
        "city": {"enum": ["Oslo", "Rome"]}}, "required": ["city"]}},
        "type": "object", "properties": {"home": {"$ref": "#/$defs/Addr"}},
        "required": ["home"]}
    tool = {"type": "function", "function": {"name": "where", "parameters": person}}
    r = _chat(client, tools=[tool], tool_choice="required", temperature=0, max_tokens=120,
              parallel_tool_calls=False).json()
    call = r["choices"][0]["message"]["tool_calls"][0]
    assert json.loads(call["function"]["arguments"])["home"]["city"] in ("Oslo", "Rome")
    r = _chat(client, guided_choice=["yes", "no"], logprobs=True, top_logprobs=5,
              temperature=0).json()
    for entry in r["choices"][0]["logprobs"]["content"]:
        assert all(t["logprob"] is not None for t in entry["top_logprobs"])
