"""Conversation keys for prefix affinity (policy.py): hashes of a request's prefix.

Chat: a chain of hashes over (model, cache_salt) and then each message, so that the
prefix of turn 2 (its messages before the last user message) extends the whole message
list of turn 1. A request is looked up by the keys of its prefixes, longest first, ending
before its last user message; it is remembered under the key of its whole message list
(what its replica now caches). Only whole message lists are remembered, so chats that
merely share a system prompt are not pulled onto one replica.
Completions: one key over (model, cache_salt, the prompt's first 1,024 characters).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

COMPLETION_PREFIX_CHARS = 1024


@dataclass(slots=True, frozen=True)
class RequestKeys:
    """Keys to look up (longest prefix first) and keys to remember after routing."""

    lookup: tuple[int, ...] = ()
    remember: tuple[int, ...] = ()


def _digest(parts: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(parts, digest_size=8).digest(), "big")


def _canonical(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def chat_keys(body: dict[str, Any]) -> RequestKeys:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return RequestKeys()
    chain = [_digest(_canonical([body.get("model"), body.get("cache_salt")]))]
    for message in messages:  # chain[j]: the key of messages[:j]
        chain.append(_digest(chain[-1].to_bytes(8, "big") + _canonical(message)))
    last_user = max((j for j, m in enumerate(messages)
                     if isinstance(m, dict) and m.get("role") == "user"), default=0)
    lookup = tuple(chain[j] for j in range(last_user, 0, -1))
    return RequestKeys(lookup, (chain[len(messages)],))


def completion_keys(body: dict[str, Any]) -> RequestKeys:
    prompt = body.get("prompt")
    if not isinstance(prompt, str):  # token ids or a batch: no affinity
        return RequestKeys()
    key = _digest(_canonical([body.get("model"), body.get("cache_salt"),
                              prompt[:COMPLETION_PREFIX_CHARS]]))
    return RequestKeys((key,), (key,))


def responses_keys(body: dict[str, Any]) -> RequestKeys:
    """/v1/responses: `input` as a message list is keyed like a chat."""
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if isinstance(body.get("instructions"), str) and isinstance(items, list):
        items = [{"role": "system", "content": body["instructions"]}, *items]
    return chat_keys({"model": body.get("model"), "cache_salt": body.get("cache_salt"),
                      "messages": items})


def request_keys(path: str, body: dict[str, Any]) -> RequestKeys:
    if path == "/v1/chat/completions":
        return chat_keys(body)
    if path == "/v1/completions":
        return completion_keys(body)
    if path == "/v1/responses":
        return responses_keys(body)
    return RequestKeys()
