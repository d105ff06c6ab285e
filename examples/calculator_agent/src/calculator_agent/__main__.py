"""Run the agent once against a session server and show what the session recorded.

    python -m calculator_agent --server http://127.0.0.1:30100 --question "What is 17 * 23?"
"""

from __future__ import annotations

import argparse
import asyncio
import json

import httpx
from miles_contracts.wire.auth import auth_headers

from calculator_agent.agent import run_agent


async def main(server: str, question: str, max_tokens: int, temperature: float) -> None:
    # The run's token opens and collects the session (MILES_AUTH_TOKEN, as the server was given);
    # the agent itself gets only the session's own key.
    async with httpx.AsyncClient(base_url=server, timeout=600, headers=auth_headers(), trust_env=False) as http:
        session = (await http.post("/sessions")).json()
        result = await run_agent(session["base_url"], question, {"max_tokens": max_tokens, "temperature": temperature},
                                 {"api_key": session["api_key"]})
        view = (await http.delete(f"/sessions/{session['session_id']}")).json()
    print(json.dumps({"agent_result": result}, indent=2))
    for record in view["records"]:
        print(f"turn {record['turn']}: {len(record['input_ids'])} prompt ids, {len(record['output_ids'])} sampled ids, "
              f"finish={record['finish_reason']}, rolled_back={record['rolled_back']}, "
              f"message={json.dumps(record['message'])[:200]}")
    print(f"conversation: {len(view['token_ids'])} token ids")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", default="http://127.0.0.1:30100", help="session server URL")
    parser.add_argument("--question", default="What is 17 * 23?")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    asyncio.run(main(args.server, args.question, args.max_tokens, args.temperature))
