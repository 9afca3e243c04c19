"""Tools as a recipe names them, the JSON schema the model is shown, and the check of a call's
arguments against it.

A tool is a plain Python function with type hints and a Google-style docstring describing each
argument (TRL's convention): its schema is transformers' ``get_json_schema`` of it. It is named
as reward functions are (``package.module:fn``, ``path/to/file.py:fn``, or the function itself
from Python; loaded by :func:`rl_envs.reward_functions.load_reward_function`, which loads any
function reference) or by a built-in name (:data:`BUILTIN_TOOLS`)::

    tools:
      - calculator
      - {function: search, kwargs: {corpus: docs.jsonl, top_k: 3}}
      - {function: my_tools.py:lookup, name: lookup}

``kwargs`` are arguments fixed by the config: the model neither sees nor sets them (a corpus's
path, a sandbox's limits). A built-in's options are always hidden from the model, set or not.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from rl_distributed.config import ConfigModel
from rl_envs.reward_functions import load_reward_function, reference_for, resolve_reference


@dataclass(frozen=True)
class BuiltinTool:
    function: str  # its import path
    options: tuple[str, ...] = ()  # arguments the config sets (``kwargs``), never the model
    required: tuple[str, ...] = ()  # options without which it cannot run
    paths: tuple[str, ...] = ()  # options that are file paths (made absolute)
    # Modules its worker processes import at start, not under the first call's timeout.
    preload: tuple[str, ...] = ()
    # A function its worker processes call with its kwargs as each starts, not under a call's
    # timeout: what every call needs and takes long to make (the search tool's index).
    prepare: str | None = None


BUILTIN_TOOLS = {
    "calculator": BuiltinTool("rl_envs.tools.builtin:calculator", preload=("simpleeval",)),
    "python": BuiltinTool(
        "rl_envs.tools.builtin:python", options=("limits",), preload=("rl_envs.code.sandbox",)
    ),
    "search": BuiltinTool(
        "rl_envs.tools.builtin:search",
        options=("corpus", "top_k"),
        required=("corpus",),
        paths=("corpus",),
        preload=("bm25s",),
        prepare="rl_envs.tools.builtin:prepare_search",
    ),
}

# What OpenAI's API accepts as a function's name; chat templates print it as it is.
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def builtin_for(function: str) -> tuple[str, BuiltinTool] | None:
    """The built-in tool (its name and entry) whose import path is ``function``, if any."""
    return next(((n, b) for n, b in BUILTIN_TOOLS.items() if b.function == function), None)


class ToolSpec(ConfigModel):
    # A built-in name (calculator, python, search), "package.module:function" or
    # "path/to/file.py:function"; from Python, the function itself.
    function: str
    # The name the model calls it by; None: the function's name.
    name: str | None = None
    # Arguments set here rather than by the model (hidden from its schema).
    kwargs: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, data: Any) -> Any:
        # A bare entry (``- calculator``, ``- my_tools.py:lookup``, a function) is its function.
        return {"function": data} if isinstance(data, str) or callable(data) else data

    @field_validator("function", mode="before")
    @classmethod
    def _callable(cls, function: Any) -> Any:
        return reference_for(function) if callable(function) else function

    @field_validator("function")
    @classmethod
    def _loads(cls, ref: str) -> str:
        if ref in BUILTIN_TOOLS:
            return BUILTIN_TOOLS[ref].function
        if ":" not in ref:
            raise ValueError(
                f"{ref!r} is neither a built-in tool ({sorted(BUILTIN_TOOLS)}) nor "
                "'package.module:function' nor 'path/to/file.py:function'"
            )
        # Imported now, at config validation, so that a typo fails before any worker starts.
        load_reward_function(ref)
        return resolve_reference(ref)

    @model_validator(mode="after")
    def _checked(self) -> ToolSpec:
        builtin = builtin_for(self.function)
        if builtin is not None:
            name, entry = builtin
            unknown = sorted(set(self.kwargs) - set(entry.options))
            if unknown:
                raise ValueError(
                    f"tool {name!r} has no option {unknown[0]!r} (its kwargs: "
                    f"{list(entry.options) or 'none'})"
                )
            missing = [o for o in entry.required if o not in self.kwargs]
            if missing:
                raise ValueError(f"tool {name!r} needs kwargs.{missing[0]}")
            for option in entry.paths:
                path = Path(str(self.kwargs[option])).expanduser().resolve()
                if not path.is_file():
                    raise ValueError(f"tool {name!r}: kwargs.{option}: no such file {str(path)!r}")
                # Absolute: the workers that run tools need not share this directory.
                self.kwargs[option] = str(path)
        if self.name is None:
            self.name = getattr(load_reward_function(self.function), "__name__", "")
        if not _TOOL_NAME.fullmatch(self.name):
            raise ValueError(
                f"tool name {self.name!r}: use 1 to 64 letters, digits, '_' or '-' (give 'name')"
            )
        tool_schema(self)  # a function without type hints or argument docs fails here
        return self


def _hidden(spec: ToolSpec) -> set[str]:
    builtin = builtin_for(spec.function)
    return set(spec.kwargs) | set(builtin[1].options if builtin else ())


def tool_schema(spec: ToolSpec) -> dict[str, Any]:
    """The tool as the model is shown it: ``{"type": "function", "function": {name,
    description, parameters}}`` from the function's signature and docstring, named as the
    config names it, without the arguments the config sets."""
    from transformers.utils import get_json_schema

    function = load_reward_function(spec.function)
    try:
        schema = copy.deepcopy(get_json_schema(function))
    except Exception as e:
        raise ValueError(
            f"tool {spec.name or spec.function!r}: no JSON schema can be made of it ({e}); a tool "
            "needs type hints and a docstring with an 'Args:' line for each argument"
        ) from e
    parameters = schema["function"].setdefault("parameters", {"type": "object", "properties": {}})
    hidden = _hidden(spec)
    unknown = sorted(set(spec.kwargs) - set(parameters.get("properties", {})))
    if unknown:
        raise ValueError(f"tool {spec.name!r}: kwargs.{unknown[0]} is not one of its arguments")
    parameters["properties"] = {
        k: v for k, v in parameters.get("properties", {}).items() if k not in hidden
    }
    parameters["required"] = [k for k in parameters.get("required", []) if k not in hidden]
    schema["function"]["name"] = spec.name
    schema["function"].pop("return", None)
    return schema


def _json_schema_types(schema: Any) -> Any:
    """``schema`` in standard JSON Schema: ``get_json_schema`` marks an optional argument
    ``nullable`` (an OpenAPI word that validators ignore); there ``null`` joins its types."""
    if isinstance(schema, list):
        return [_json_schema_types(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _json_schema_types(v) for k, v in schema.items() if k != "nullable"}
    if schema.get("nullable") and "type" in out:
        types = out["type"] if isinstance(out["type"], list) else [out["type"]]
        out["type"] = [*types, "null"]
    return out


class Tool:
    """A configured tool: its name, function, fixed arguments and schema, and the check of a
    call's arguments."""

    def __init__(self, spec: ToolSpec) -> None:
        from jsonschema import Draft202012Validator

        self.name: str = spec.name or ""
        self.function = spec.function
        self.kwargs = dict(spec.kwargs)
        self.schema = tool_schema(spec)
        parameters = _json_schema_types(self.schema["function"]["parameters"])
        # Arguments the tool does not take are mistakes the model should hear of.
        self._validator = Draft202012Validator({**parameters, "additionalProperties": False})

    def argument_errors(self, arguments: Mapping[str, Any]) -> list[str]:
        """What is wrong with ``arguments`` (missing, unknown, of the wrong JSON type); empty
        when the call may run."""
        errors = sorted(self._validator.iter_errors(arguments), key=lambda e: list(e.path))
        return [(f"{'.'.join(map(str, e.path))}: " if e.path else "") + e.message for e in errors]

    def describe_parameters(self) -> str:
        """The arguments it takes, for error messages."""
        return json.dumps(self.schema["function"]["parameters"], separators=(",", ":"))
