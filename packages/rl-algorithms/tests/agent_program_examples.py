"""Agent programs for test_agent_programs.py and the collector's tests, loaded as
agent_program.function (by path): a good one, a tool user, and each way a program can go wrong,
chosen by the row's ``behaviour``."""

import asyncio
import json
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import openai


def client(base_url):
    return openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)


def talk(base_url, row):
    """Two turns; returns what it saw (the replies and their token ids) and its base URL."""
    api = client(base_url)
    messages = list(row["messages"])
    seen = []
    for again in ("Once more.", None):
        reply = api.chat.completions.create(model="policy", messages=messages)
        choice = reply.choices[0]
        seen.append({"content": choice.message.content, "token_ids": choice.token_ids})
        messages.append(choice.message.model_dump(exclude_none=True))
        if again:
            messages.append({"role": "user", "content": again})
    return {"seen": seen, "base_url": base_url}


async def talk_async(base_url, row):
    api = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
    reply = await api.chat.completions.create(model="policy", messages=row["messages"])
    return reply.choices[0].token_ids


def refused(call):
    try:
        call()
    except openai.BadRequestError as e:
        return e.message
    raise AssertionError("the endpoint did not refuse")


def misbehave(base_url, row):
    behaviour = row["behaviour"]
    api = client(base_url)
    if behaviour == "good":
        return talk(base_url, row)
    if behaviour == "never_calls":
        return "done without the model"
    if behaviour == "raises":
        api.chat.completions.create(model="policy", messages=row["messages"])
        raise RuntimeError("the agent broke")
    if behaviour == "hangs":  # past its deadline, then calls: refused
        api.chat.completions.create(model="policy", messages=row["messages"])
        # Held until the test has its rollout back: a rollout that waited for this program
        # would never return (so the test proves the cut without timing anything).
        release = Path(row["report"]).with_suffix(".release")
        deadline = time.monotonic() + 120
        while not release.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        message = refused(
            lambda: api.chat.completions.create(model="policy", messages=row["messages"])
        )
        # Written aside, then renamed: the test waits for the report to exist, and must not
        # read it between its creation and its text.
        written = Path(row["report"]).with_suffix(".writing")
        written.write_text(message)
        written.replace(row["report"])
        return None
    if behaviour == "unpicklable":  # a result no process but this one could receive
        api.chat.completions.create(model="policy", messages=row["messages"])
        return {"answer": 4, "lock": threading.Lock()}
    if behaviour == "local_class":  # Ray's cloudpickle sends it, a checkpoint cannot hold it

        class Answer:
            value = 4

        api.chat.completions.create(model="policy", messages=row["messages"])
        return Answer()
    if behaviour == "diverges":
        first = api.chat.completions.create(model="policy", messages=row["messages"])
        rewritten = [{"role": "user", "content": "something else entirely"}]
        rewritten.append(first.choices[0].message.model_dump(exclude_none=True))
        rewritten.append({"role": "user", "content": "go on"})
        message = refused(lambda: api.chat.completions.create(model="policy", messages=rewritten))
        return {"refusal": message}
    raise ValueError(behaviour)


def asks_for_what_the_run_does_not_do(base_url, row):
    """Each refused request, then a good one: the episode still counts."""
    api, messages = client(base_url), row["messages"]
    refusals = {
        "stream": refused(
            lambda: api.chat.completions.create(model="p", messages=messages, stream=True)
        ),
        "temperature": refused(
            lambda: api.chat.completions.create(model="p", messages=messages, temperature=0.3)
        ),
        "n": refused(lambda: api.chat.completions.create(model="p", messages=messages, n=2)),
        "max_completion_tokens": refused(
            lambda: api.chat.completions.create(
                model="p", messages=messages, max_completion_tokens=0, max_tokens=5
            )
        ),
    }
    reply = api.chat.completions.create(model="p", messages=messages, max_tokens=2)
    choice = reply.choices[0]
    return {"refusals": refusals, "finish": choice.finish_reason, "ids": choice.token_ids}


def uses_a_tool(base_url, row):
    """Calls the tool the model asks for, as an OpenAI agent does, then takes its answer."""
    api, messages = client(base_url), list(row["messages"])
    first = api.chat.completions.create(model="p", messages=messages, tools=row["tools"])
    call = first.choices[0].message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append(
        {"role": "tool", "tool_call_id": call.id, "content": str(eval(arguments["expression"]))}
    )
    final = api.chat.completions.create(model="p", messages=messages, tools=row["tools"])
    return {
        "call": [call.function.name, arguments, first.choices[0].finish_reason],
        "answer": final.choices[0].message.content,
    }


def completes_text(base_url, row):
    """Two /v1/completions requests, the second extending the first with the reply."""
    api = client(base_url)
    prompt = row["messages"][0]["content"]
    first = api.completions.create(model="p", prompt=prompt)
    second = api.completions.create(model="p", prompt=prompt + first.choices[0].text + " more")
    return [first.choices[0].token_ids, second.choices[0].token_ids]


def over_http(base_url, row):
    """Plain httpx, as a program without the openai package would."""
    response = httpx.post(
        f"{base_url}/chat/completions", json={"model": "p", "messages": row["messages"]}
    )
    return response.json()["choices"][0]["token_ids"]


def _answered(api, messages, then):
    """One request, its reply added to ``messages``, then the message ``then``."""
    reply = api.chat.completions.create(model="p", messages=messages)
    messages += [reply.choices[0].message.model_dump(exclude_none=True), then]
    return reply.choices[0].token_ids


def retries_what_the_template_refuses(base_url, row):
    """A system message late in the conversation (the template refuses it), then the same
    turn as a user message: what the first try sent must leave no trace."""
    api, messages = client(base_url), list(row["messages"])
    first = _answered(api, messages, {"role": "system", "content": "Be brief."})
    refusal = refused(lambda: api.chat.completions.create(model="p", messages=messages))
    messages[-1] = {"role": "user", "content": "Be brief."}
    second = api.chat.completions.create(model="p", messages=messages).choices[0].token_ids
    return {"refusal": refusal, "seen": [first, second]}


def outgrows_the_context(base_url, row):
    """A second turn too long to leave room for an answer, then returns."""
    api, messages = client(base_url), list(row["messages"])
    first = _answered(api, messages, {"role": "user", "content": "Solve this " * 400})
    refusal = refused(lambda: api.chat.completions.create(model="p", messages=messages))
    return {"refusal": refusal, "seen": [first]}


def talks_and_reports_errors(base_url, row):
    """``talk``; an error the endpoint answers instead is appended to ``row["report"]`` (one
    JSON line: status and message), then raised."""
    try:
        return talk(base_url, row)
    except openai.APIStatusError as e:
        with open(row["report"], "a") as f:
            f.write(json.dumps({"status": e.status_code, "message": e.message}) + "\n")
        raise


_episodes_started = Counter()  # per report file: episodes of the row started in this process
_counting = threading.Lock()


def hangs_the_first_time(base_url, row):
    """The first ``row["hangs"]`` episodes of the row ask once, then hang in their own code
    until the file ``<report>.release`` exists, then ask again (``talks_and_reports_errors``);
    later episodes talk."""
    with _counting:
        _episodes_started[row["report"]] += 1
        hangs = _episodes_started[row["report"]] <= row["hangs"]
    if not hangs:
        return talk(base_url, row)
    client(base_url).chat.completions.create(model="policy", messages=row["messages"])
    release = Path(row["report"] + ".release")
    deadline = time.monotonic() + 60
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return talks_and_reports_errors(base_url, row)


def never_asks(base_url, row):
    """Returns without ever calling the endpoint (nothing sampled, nothing to train on)."""
    return {"seen": []}


async def waits_until_cancelled(base_url, row):
    """Asks once, then waits; writes "cancelled" to ``row["report"]`` when its task is
    (whether that is while it asks or while it waits)."""
    api = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
    try:
        await api.chat.completions.create(model="policy", messages=row["messages"])
        await asyncio.sleep(120)
    except asyncio.CancelledError:
        Path(row["report"]).write_text("cancelled")
        raise
