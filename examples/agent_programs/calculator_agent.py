"""A tool-using agent written against the plain OpenAI client; nothing in it knows `rl`."""

import json

from openai import OpenAI

PARAMETERS = {"type": "object", "properties": {"expression": {"type": "string"}}}
FUNCTION = {
    "name": "calculator",
    "description": "Evaluate 12*(3+4) or such.",
    "parameters": PARAMETERS,
}
CALCULATOR = {"type": "function", "function": FUNCTION}


def calculate(expression: str) -> str:
    try:
        assert set(expression) <= set("0123456789+-*/(). "), "only numbers, + - * / and brackets"
        return str(eval(expression, {"__builtins__": {}}))
    except Exception as e:
        return f"error: {e}"


def agent(base_url: str, row: dict) -> str:
    client = OpenAI(base_url=base_url, api_key="unused")
    messages = list(row["messages"])
    for _ in range(3):  # the model may call the calculator twice, then answers
        reply = client.chat.completions.create(
            model="policy", messages=messages, tools=[CALCULATOR]
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            expression = str(json.loads(call.function.arguments).get("expression", ""))
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": calculate(expression)}
            )
    return ""
