"""An agent that trains the model it calls: the plain `openai` client against a run's endpoint.

    python examples/calc_agent.py --launch          # a CPU run of the built-in tools model, and this agent
    python examples/calc_agent.py --run RUN_DIR     # this agent, against a run started with episode.agents=true

Each episode: ask for a list's sum, run the calculator the model calls, answer, reward the
episode (1 for the right sum). Eight attempts at each list run side by side, one session each:
episodes from the same prompt make a GRPO group (docs/agents.md). The built-in model reads
"[12,30]=" and calls `<calc>12+30</calc>`; a chat model would get words and JSON tool calls.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "adds numbers",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]


def calculator(expression: str) -> str:
    try:
        return str(sum(int(x) for x in expression.split("+")))
    except ValueError:
        return "error: only sums of integers"


def episode(client: openai.OpenAI, numbers: list[int]) -> float:
    session = uuid.uuid4().hex
    messages = [{"role": "user", "content": "[" + ",".join(map(str, numbers)) + "]="}]
    for _ in range(3):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                               max_tokens=48, extra_body={"session_id": session})
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": calculator(args.get("expression", ""))})
    answer = (message.content or "").rpartition(">")[2].strip()
    reward = 1.0 if answer == str(sum(numbers)) else 0.0
    client.post(f"/episodes/{session}/reward", body={"reward": reward}, cast_to=object)
    return reward


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", help="a run directory (its agents.json)")
    ap.add_argument("--launch", action="store_true", help="start a CPU run to train")
    ap.add_argument("--steps", type=int, default=30, help="--launch: training steps")
    ap.add_argument("--group", type=int, default=8, help="attempts per list (the run's n_samples_per_prompt)")
    args = ap.parse_args()
    run, trainer = Path(args.run or f"runs/calc-agent-{time.strftime('%H%M%S')}"), None
    if args.launch:
        trainer = subprocess.Popen([sys.executable, "-m", "trainer", "run", "agent", "--out", str(run),
                                    "--set", "episode.agents=true", "--set", f"run.max_steps={args.steps}",
                                    "--set", "run.eval_every=0"])
    while not (run / "agents.json").exists():
        time.sleep(0.5)
    address = json.loads((run / "agents.json").read_text())
    token = address.get("token") or os.environ["RLPILOT_AGENT_TOKEN"]   # generated, or yours
    client = openai.OpenAI(base_url=address["base_url"], api_key=token)
    rng = random.Random(0)
    with ThreadPoolExecutor(args.group) as pool:
        while trainer is None or trainer.poll() is None:
            numbers = [rng.randint(1, 99) for _ in range(rng.randint(2, 3))]
            try:
                rewards = list(pool.map(episode, [client] * args.group, [numbers] * args.group))
            except (openai.APIConnectionError, openai.APIStatusError):
                break   # the run is over
            print(f"{numbers}: {sum(rewards):.0f}/{len(rewards)} right", flush=True)


if __name__ == "__main__":
    main()
