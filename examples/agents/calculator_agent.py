"""A calculator agent written with the official `openai` package, knowing nothing of
Metronome: it reads an arithmetic task, lets the model call a `calculator` tool that
it implements itself, and prints the model's final answer.

Train it with `rollout.backend = "agent"` (README "Training an agent"): Metronome
starts it once per prompt and sample with OPENAI_BASE_URL pointing at a recording
proxy, and the task on stdin. Outside Metronome it runs against any OpenAI-compatible
server (`metronome serve`, vLLM) the same way.
"""

import ast
import json
import operator
import os
import sys
from fractions import Fraction

from openai import OpenAI

MAX_TURNS = int(os.environ.get("AGENT_MAX_TURNS", "4"))
MAX_TOKENS = int(os.environ.get("AGENT_MAX_TOKENS", "24"))

TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates + - * / and parentheses over exact rationals.",
        "parameters": {
            "type": "object",
            "properties": {"input": {"type": "string", "description": "the expression"}},
            "required": ["input"],
        },
    },
}]

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate(node):
    """The value of an arithmetic expression's syntax tree; anything else is refused."""
    if isinstance(node, ast.Expression):
        return evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -evaluate(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        return OPS[type(node.op)](evaluate(node.left), evaluate(node.right))
    raise ValueError("only integers, + - * / and parentheses")


def calculator(arguments):
    """The tool: the expression's value, or what was wrong, as the model reads it."""
    try:
        expression = json.loads(arguments).get("input", "")
        value = evaluate(ast.parse(expression, mode="eval"))
        return str(value.numerator) if value.denominator == 1 else str(value)
    except (ValueError, SyntaxError, ZeroDivisionError, AttributeError, TypeError, RecursionError) as e:
        return f"error: {e}"


def main():
    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    model = os.environ.get("METRONOME_MODEL", "metronome")
    messages = [{"role": "user", "content": sys.stdin.read()}]
    answer = ""
    for _ in range(MAX_TURNS):
        r = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=MAX_TOKENS)
        message = r.choices[0].message
        if not message.tool_calls:
            answer = message.content or ""
            break
        messages.append(message)
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculator(call.function.arguments)})
    print(json.dumps({"answer": answer}))


if __name__ == "__main__":
    main()
