"""Talk to `tf-async serve` with the official openai package (streaming chat and completions).

    tf-async serve &            # default model on 127.0.0.1:8000
    python examples/openai_client.py [--url http://127.0.0.1:8000] [--api-key KEY]
"""

from __future__ import annotations

import argparse

import openai


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default="unused")  # needed only with `serve --api-key`
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.url + "/v1", api_key=args.api_key)
    model = client.models.list().data[0].id

    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Write a haiku about the sea."}],
        max_tokens=64, temperature=0.7, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
        elif chunk.usage:
            print(f"\n[{chunk.usage.completion_tokens} tokens]")

    for chunk in client.completions.create(model=model, prompt="The capital of France is",
                                           max_tokens=16, temperature=0, stream=True):
        print(chunk.choices[0].text, end="", flush=True)
    print()

    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=16,
        extra_body={"top_k": 40, "min_p": 0.05})  # tf_async extensions
    print(reply.choices[0].message.content, reply.usage)


if __name__ == "__main__":
    main()
