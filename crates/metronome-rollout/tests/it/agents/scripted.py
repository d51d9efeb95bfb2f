"""A scripted agent for the agent backend's tests: what it does is the task's text
(on stdin). Plain `urllib`, so the tests need no package beyond python3.

  join       two calls, the second re-sending the first with a tool answer
  split      two calls, the second rewriting the history (a summary)
  crash      one call, then exit status 3
  hang       one call, start a child, write both pids to $PIDS_DIR, sleep
  silent     no call, exit 0
  wrong_key  one call, then a call to another episode's address, then sleep
"""

import json
import os
import sys
import time
import urllib.error
import urllib.request

BASE = os.environ["OPENAI_BASE_URL"]
KEY = os.environ["OPENAI_API_KEY"]
MODEL = os.environ["METRONOME_MODEL"]


def chat(messages, base=BASE):
    body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 1.0}).encode()
    request = urllib.request.Request(
        base + "/chat/completions",
        data=body,
        headers={"Content-Type": "application/json", "Authorization": "Bearer " + KEY},
    )
    with urllib.request.urlopen(request) as r:
        return json.load(r)["choices"][0]["message"]["content"] or ""


task = sys.stdin.read().strip()
user = {"role": "user", "content": task}
if task == "silent":
    sys.exit(0)
first = chat([user])
if task == "join":
    chat([user, {"role": "assistant", "content": first}, {"role": "tool", "content": "6"}])
elif task == "split":
    chat([{"role": "user", "content": "summary: " + task}])
elif task == "crash":
    sys.exit(3)
elif task == "hang":
    import subprocess

    child = subprocess.Popen(["sleep", "1000"])
    with open(os.path.join(os.environ["PIDS_DIR"], "pids"), "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    time.sleep(1000)
elif task == "wrong_key":
    other = BASE.replace("/episodes/", "/episodes/x")
    try:
        chat([user], base=other)
    except urllib.error.HTTPError as e:
        print(e.code, file=sys.stderr)
    time.sleep(1000)
print(json.dumps({"reward": 0.5}))
