"""The official `openai` client against Metronome's chat endpoint (run by chat.rs).

Usage: chat_client.py BASE_URL. Exits 3 when the `openai` package is missing.
"""

import json
import sys

try:
    from openai import OpenAI
except ImportError as e:
    print(f"no openai package: {e}", file=sys.stderr)
    sys.exit(3)

client = OpenAI(base_url=sys.argv[1], api_key="unused")

# Chat with n > 1 and log-probs.
r = client.chat.completions.create(
    model="tiny",
    messages=[{"role": "system", "content": "Add."}, {"role": "user", "content": "1 + 2 = "}],
    n=2,
    max_tokens=8,
    seed=3,
    logprobs=True,
    temperature=1.0,
)
assert r.object == "chat.completion", r
assert len(r.choices) == 2, r
for c in r.choices:
    assert c.message.role == "assistant"
    assert c.logprobs is not None and len(c.logprobs.content) >= 1
    assert all(t.logprob <= 0.0 for t in c.logprobs.content)
assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
assert r.system_fingerprint.startswith("metronome-v")

# A tool loop: the call comes back in the assistant message the client builds.
tools = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"input": {"type": "string"}}},
    },
}]
messages = [{"role": "user", "content": "2 * 3 = "}]
r = client.chat.completions.create(model="tiny", messages=messages, tools=tools, max_tokens=6, seed=4)
choice = r.choices[0]
assert choice.finish_reason == "tool_calls", choice
call = choice.message.tool_calls[0]
assert call.function.name == "calculator"
json.loads(call.function.arguments)
messages.append(choice.message)
messages.append({"role": "tool", "tool_call_id": call.id, "content": "6"})
r = client.chat.completions.create(model="tiny", messages=messages, tools=tools, max_tokens=6, seed=4)
assert len(r.choices) == 1

# An error in OpenAI's shape reaches the client as its exception.
try:
    client.chat.completions.create(model="tiny", messages=[], max_tokens=4)
    raise AssertionError("an empty conversation was served")
except Exception as e:  # openai.BadRequestError
    assert getattr(e, "status_code", None) == 400, e

print("ok")
