"""benchmarks/serve_load.py's client: it asks for the model the server serves (a real model too, not only
the shipped pair), and counts the tokens of each streamed chunk."""

from __future__ import annotations

import argparse
import asyncio
import json

import httpx

from benchmarks import serve_load


def test_a_request_names_the_model_it_is_given_and_counts_the_streamed_tokens() -> None:
    seen: list[dict] = []
    chunks = [{"choices": [{"token_ids": [5, 6]}]}, {"choices": [{"token_ids": [7]}]}]

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    async def one() -> dict:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            args = argparse.Namespace(max_tokens=3, temperature=0.0, timeout=5.0)
            return await serve_load.one_request(
                client, "http://127.0.0.1:1", "Once", args, "SmolLM2.Q4_1.gguf"
            )

    figures = asyncio.run(one())
    assert (
        seen[0]["model"] == "SmolLM2.Q4_1.gguf"
        and seen[0]["prompt"] == "Once"
        and seen[0]["stream"] is True
    )
    assert figures["tokens"] == 3 and len(figures["itl"]) == 1
