"""The async Python API without a server: stream, complete, chat, stop a stream early.

    python examples/python_api.py [--model PATH]
"""

from __future__ import annotations

import argparse
import asyncio

from tf_async import Engine


async def main_async(model: str | None) -> None:
    async with Engine(model, parallel=4, ctx=2048) as engine:
        async for delta in engine.stream("The three primary colours are", max_tokens=32):
            print(delta.text, end="", flush=True)
        print()

        messages = [{"role": "user", "content": "Name a fruit."}]
        answers = await asyncio.gather(*(
            engine.chat_complete(messages, max_tokens=16, temperature=0.8, seed=seed)
            for seed in range(4)))  # four streams share the engine's lanes
        for answer in answers:
            print(repr(answer.text), answer.finish_reason, answer.usage)

        # Stop early: leaving the `async with` block cancels the request and returns once its
        # lane and pages are released (a bare `break` releases them a round later).
        async with engine.chat(messages, max_tokens=200) as deltas:
            async for delta in deltas:
                if delta.token_ids:
                    break
        stats = engine.stats()
        print({key: stats[key] for key in ("lanes_in_use", "running", "pages_in_use")})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    args = parser.parse_args()
    asyncio.run(main_async(args.model))


if __name__ == "__main__":
    main()
