"""Tool calls read from generated text per model family, tools' schemas and argument checks,
and the built-in tools (calculator, search, python), all in process."""

import json

import pytest

from rl_envs.tools.builtin import calculator, python, python_tool_limits, search
from rl_envs.tools.env import ToolEnvConfig
from rl_envs.tools.parsers import parse_tool_calls
from rl_envs.tools.registry import Tool, ToolSpec

# (format, generated text, the calls expected: (name, arguments) or ("error", part of it),
# the text left around them)
CASES = [
    (  # Hermes / Qwen2.5: two calls in one turn, text before, between and after
        "hermes",
        'Let me look.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
        '\n<tool_call>\n{"name": "search", "arguments": {"query": "rl"}}\n</tool_call>\nDone.',
        [("add", {"a": 1, "b": 2}), ("search", {"query": "rl"})],
        "Let me look.\n\n\nDone.",
    ),
    (  # malformed JSON: that call is an error, the good one beside it stays
        "hermes",
        '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>',
        [("error", "not valid JSON"), ("add", {"a": 2})],
        "",
    ),
    (  # SmolLM2's function-calling form: a JSON list of calls in one region
        "hermes",
        '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": [1]}}]'
        "</tool_call>",
        [("a", {}), ("b", {"x": [1]})],
        "",
    ),
    (  # arguments as OpenAI's JSON string; a call without a name; arguments that are a list
        "hermes",
        '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>'
        '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": [1]}'
        "</tool_call>",
        [("a", {"x": 1}), ("error", 'needs a "name"'), ("error", "must be a JSON object")],
        "",
    ),
    ("hermes", "The answer is 42.", [], "The answer is 42."),
    ("hermes", "<tool_call>", [("error", "not valid JSON")], ""),  # cut off mid-call
    (  # Llama 3.1 JSON: the turn starts with the call
        "llama3_json",
        '{"name": "add", "parameters": {"a": 1, "b": 2}}',
        [("add", {"a": 1, "b": 2})],
        "",
    ),
    (  # two calls separated by ';', text after them
        "llama3_json",
        ' {"name": "a", "parameters": {}}; {"name": "b", "parameters": {"q": "x"}} then done',
        [("a", {}), ("b", {"q": "x"})],
        "then done",
    ),
    (  # text, then a call after <|python_tag|>
        "llama3_json",
        'I will search. <|python_tag|>{"name": "search", "parameters": {"query": "q"}}',
        [("search", {"query": "q"})],
        "I will search.",
    ),
    ("llama3_json", '{"name": "add", "parameters": {"a": ', [("error", "not valid JSON")], ""),
    ("llama3_json", "The set is {1, 2}.", [], "The set is {1, 2}."),  # braces later: no call
    (  # Mistral v3: [TOOL_CALLS] and a JSON list
        "mistral",
        'Checking. [TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, '
        '{"name": "b", "arguments": {}}]',
        [("a", {"x": 1}), ("b", {})],
        "Checking.",
    ),
    ("mistral", '[TOOL_CALLS] [{"name": "a", "arguments": {', [("error", "not valid JSON")], ""),
    ("mistral", "No tools needed: 7.", [], "No tools needed: 7."),
]


@pytest.mark.parametrize(("fmt", "text", "expected", "rest"), CASES)
def test_calls_are_read_from_each_format(fmt, text, expected, rest):
    turn = parse_tool_calls(text, fmt, first_id=5)
    assert [c.id for c in turn.calls] == [f"call_{5 + k}" for k in range(len(expected))]
    for call, (name, what) in zip(turn.calls, expected, strict=True):
        if name == "error":
            assert call.error is not None and what in call.error
        else:
            assert (call.name, call.arguments, call.error) == (name, what, None)
    assert turn.text == rest


TOOLS_FILE = '''
def lookup(key: str, limit: int = 3, tags: list[str] | None = None, store: str = "") -> str:
    """Look a key up.

    Args:
        key: The key.
        limit: At most this many results.
        tags: Only these tags.
        store: Where to look (set by the config).
    """
    return key

def undocumented(key: str) -> str:
    return key
'''


@pytest.fixture
def tools_file(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(TOOLS_FILE)
    return path


@pytest.mark.parametrize(
    ("fmt", "wrap"),
    [
        ("hermes", lambda call: f"<tool_call>{call}</tool_call>"),
        ("llama3_json", lambda call: call),
        ("mistral", lambda call: f"[TOOL_CALLS][{call}]"),
    ],
)
def test_degenerate_calls_become_errors_never_a_crash(fmt, wrap):
    """What a collapsing policy writes: JSON nested past Python's recursion limit (in the call
    and in arguments given as a string), and a call of megabytes."""
    deep = '{"name": "calculator", "arguments": {"expression": ' + "[" * 5000 + "]" * 5000 + "}}"
    deep_string = json.dumps({"name": "calculator", "arguments": "[" * 5000 + "]" * 5000})
    huge = json.dumps({"name": "calculator", "arguments": {"expression": "1+" * 200_000 + "1"}})
    for call, error in (
        (deep, "nested too deeply"),
        (deep_string, "nested too deeply"),
        (huge, "over the limit"),
    ):
        calls = parse_tool_calls(wrap(call), fmt).calls
        assert len(calls) == 1 and error in calls[0].error, (call[:40], calls)


def test_a_tools_schema_comes_from_its_signature_without_the_configs_arguments(tools_file):
    spec = ToolSpec(function=f"{tools_file}:lookup", name="find", kwargs={"store": "db"})
    schema = Tool(spec).schema["function"]
    assert schema["name"] == "find"
    assert schema["description"] == "Look a key up."
    assert sorted(schema["parameters"]["properties"]) == ["key", "limit", "tags"]
    assert schema["parameters"]["required"] == ["key"]


def test_arguments_are_checked_against_the_schema(tools_file):
    tool = Tool(ToolSpec(function=f"{tools_file}:lookup"))
    assert tool.argument_errors({"key": "x", "tags": None}) == []  # Optional takes null
    assert tool.argument_errors({"key": "x", "limit": 2, "tags": ["a"]}) == []
    assert tool.argument_errors({}) == ["'key' is a required property"]
    (unknown,) = tool.argument_errors({"key": "x", "color": "red"})
    assert "'color' was unexpected" in unknown
    assert tool.argument_errors({"key": "x", "store": "y"}) == []
    # Once the config sets "store", the model may not.
    bound = Tool(ToolSpec(function=f"{tools_file}:lookup", kwargs={"store": "db"}))
    assert "'store' was unexpected" in bound.argument_errors({"key": "x", "store": "y"})[0]
    assert tool.argument_errors({"key": 3, "limit": "2"}) == [
        "key: 3 is not of type 'string'",
        "limit: '2' is not of type 'integer'",
    ]


def test_bad_tool_configs_are_refused_naming_what_is_wrong(tools_file, tmp_path):
    with pytest.raises(ValueError, match="neither a built-in tool"):
        ToolSpec(function="calculater")
    with pytest.raises(ValueError, match=r"needs kwargs\.corpus"):
        ToolSpec(function="search")
    with pytest.raises(ValueError, match="no such file"):
        ToolSpec(function="search", kwargs={"corpus": str(tmp_path / "none.jsonl")})
    with pytest.raises(ValueError, match="has no option 'depth'"):
        ToolSpec(function="calculator", kwargs={"depth": 2})
    with pytest.raises(ValueError, match="needs type hints and a docstring"):
        ToolSpec(function=f"{tools_file}:undocumented")
    with pytest.raises(ValueError, match=r"kwargs\.shelf is not one of its arguments"):
        ToolSpec(function=f"{tools_file}:lookup", kwargs={"shelf": 1})
    functions = [{"function": "math"}]
    with pytest.raises(ValueError, match="two tools are named 'calculator'"):
        ToolEnvConfig(tools=["calculator", "calculator"], functions=functions)
    with pytest.raises(ValueError, match="parser 'gemma'"):
        ToolEnvConfig(tools=["calculator"], parser="gemma", functions=functions)
    with pytest.raises(ValueError, match="must exceed the python tool's sandbox wall_time_s"):
        ToolEnvConfig(tools=["python"], tool_timeout_s=5, functions=functions)


def test_the_python_tools_limits_are_its_defaults_overridden_by_the_config():
    """The limits the environment checks at setup are those each call runs with
    (``python_tool_limits``): the tool's own defaults (not the code environment's), what
    ``kwargs.limits`` sets instead, and nothing when it is left empty (YAML's ``limits:``)."""
    functions = [{"function": "math"}]
    assert python_tool_limits(None) == python_tool_limits({})
    assert python_tool_limits(None).wall_time_s == 8.0  # the sandbox's own default is 20 s
    limits = python_tool_limits({"memory_mb": 256})
    assert (limits.memory_mb, limits.wall_time_s) == (256, 8.0)
    empty = {"function": "python", "kwargs": {"limits": None}}
    ToolEnvConfig(tools=[empty], tool_timeout_s=9, functions=functions)
    longer = {"function": "python", "kwargs": {"limits": {"wall_time_s": 12}}}
    with pytest.raises(ValueError, match=r"tool_timeout_s \(10\) must exceed .* \(12\)"):
        ToolEnvConfig(tools=[longer], tool_timeout_s=10, functions=functions)


def test_the_calculator_evaluates_arithmetic_and_nothing_else():
    assert calculator("(3 + 4) * 2 ** 3 - 10 // 3") == "53"
    assert float(calculator("sqrt(16) + max(1, 2) * pi")) == pytest.approx(
        4 + 2 * 3.141592653589793
    )
    refused = [
        "(1).real",  # attribute access
        "().__class__.__bases__",
        "__import__('os').system('true')",
        "import os",
        "open('/etc/passwd')",
        "x = 1",
        "1; 2",
        "[1, 2]",
        "'a' * 3",  # a string is no number
        "9 ** 9 ** 9",  # simpleeval refuses huge powers rather than hanging
        "lambda: 1",
    ]
    for expression in refused:
        with pytest.raises(Exception):  # noqa: B017 - each is refused in its own way
            calculator(expression)


def test_search_returns_the_best_matching_document_first(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    docs = [
        {"title": "Cats", "text": "Cats sleep most of the day and chase mice."},
        {"title": "France", "text": "Paris is the capital of France, on the Seine."},
        {"title": "Rivers", "text": "The Nile and the Amazon are the longest rivers."},
    ]
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
    found = search("what is the capital of France", str(corpus), top_k=2)
    assert found.startswith("[1] France\nParis is the capital of France")
    assert "Cats" not in found  # no word in common: not listed at all
    assert search("zebra", str(corpus)) == "No document matches the query."


def test_the_python_tool_runs_code_in_the_sandbox():
    assert python("print(sum(range(5)))") == "10\n"
    failed = python("print('before')\nraise ValueError('boom')")
    assert failed.startswith("before\n")
    assert "ValueError: boom" in failed and failed.endswith("(exit code 1)")
    # In the sandbox: none of our files (this one, say) are there.
    assert python(f"import os\nprint(os.path.exists({__file__!r}))") == "False\n"
