"""An agent for the pipeline's agent-backend test: two chat calls, the second
re-sending the first with a tool's answer, so most episodes are one trajectory of
two turns. Plain `urllib`: the test needs no package beyond python3."""

import json
import os
import sys
import urllib.request


def chat(messages):
    body = json.dumps({"model": os.environ["METRONOME_MODEL"], "messages": messages, "max_tokens": 12}).encode()
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=body,
        headers={"Content-Type": "application/json", "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]},
    )
    with urllib.request.urlopen(request) as r:
        return json.load(r)["choices"][0]["message"]["content"] or ""


user = {"role": "user", "content": sys.stdin.read()}
first = chat([user])
chat([user, {"role": "assistant", "content": first}, {"role": "tool", "content": "[1]"}])
