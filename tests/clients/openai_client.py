"""Talks to `headwise serve` with the official `openai` client: a chat completion, a
streamed chat completion and the model list. Prints one JSON object of what it saw;
exits non-zero on any failure. Usage: openai_client.py BASE_URL API_KEY"""

import json
import sys

import openai


def main() -> None:
    base_url, api_key = sys.argv[1], sys.argv[2]
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    models = [m.id for m in client.models.list().data]
    messages = [{"role": "user", "content": "What is the capital of France?"}]

    chat = client.chat.completions.create(
        model=models[0], messages=messages, max_tokens=8, temperature=0, seed=1
    )
    stream = client.chat.completions.create(
        model=models[0],
        messages=messages,
        max_tokens=8,
        temperature=0,
        seed=1,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"headwise": {"policy": "static-locos"}},
    )
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta.content
            if delta:
                pieces.append(delta)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    try:
        client.chat.completions.create(
            model=models[0], messages=messages, extra_body={"headwise": {"policy": "nope"}}
        )
        bad_policy = None
    except openai.BadRequestError as e:
        bad_policy = {"status": e.status_code, "message": e.message}

    print(
        json.dumps(
            {
                "models": models,
                "chat_text": chat.choices[0].message.content,
                "chat_finish": chat.choices[0].finish_reason,
                "chat_completion_tokens": chat.usage.completion_tokens,
                "chat_kv_bytes": (chat.usage.model_extra or {}).get("headwise", {}).get("kv_bytes"),
                "stream_text": "".join(pieces),
                "stream_finish": finish,
                "stream_completion_tokens": usage.completion_tokens if usage else None,
                "stream_policy": (usage.model_extra or {}).get("headwise", {}).get("policy") if usage else None,
                "bad_policy": bad_policy,
            }
        )
    )


if __name__ == "__main__":
    main()
