"""Extra training text for drafter heads: the chitchat dataset (MIT), from the PyPI wheel `chitchat-dataset`.

7,168 open-domain conversations between two people (about 3M tokens), shipped
as one JSON file inside the wheel: fetched with pip (never installed),
sha256-checked and cached like the models (`models.fetch.fetched_file`),
never committed. A conversation becomes one text in the target's chat format:
the first speaker's turns as the user's, the other's as the assistant's, so a
teacher-forced target pass over it yields features and laws at assistant-style
positions. These texts only ever add training data: they are not Spec-Bench
questions, so the held-out split is untouched.
"""

from __future__ import annotations

import json

from specdec_jax.cache import cache_dir
from specdec_jax.models.fetch import WheelFile, fetched_file

CHITCHAT = WheelFile("dataset.json", (("chitchat-dataset==0.9.0", "chitchat_dataset/dataset.json"),),
                     "d2a5d0bf6acf354fef51f3af39cbece2220d3b8f6086b658c3d335105798312a", "an 8 MB download")


def chitchat_conversations(progress: bool = True) -> dict:
    """{conversation id: {"messages": [[{"text", "sender", ...}, ...], ...]}} (a list of turns per id)."""
    path = fetched_file(CHITCHAT, cache_dir() / "chitchat" / "dataset.json", progress)
    return json.loads(path.read_text())


def conversation_messages(conversation: dict) -> list[dict]:
    """[{"role": "user" | "assistant", "content"}]: a turn's messages joined by newlines, roles
    alternating from the first speaker (the user); empty turns are dropped."""
    messages = []
    for turn in conversation["messages"]:
        text = "\n".join(m["text"].strip() for m in turn if m.get("text", "").strip())
        if text:
            messages.append({"role": "user" if len(messages) % 2 == 0 else "assistant", "content": text})
    return messages


def chitchat_records(tokenizer, limit: int, progress: bool = True) -> list[dict]:
    """[{"id", "text"}] of the first `limit` conversations (sorted by id) with at least one reply,
    each rendered with the tokenizer's chat template (sent raw to the target)."""
    conversations = chitchat_conversations(progress)
    records = []
    for key in sorted(conversations):
        messages = conversation_messages(conversations[key])
        if len(messages) >= 2:
            records.append({"id": f"chitchat-{key}", "text": tokenizer.apply_chat_template(messages)})
        if len(records) == limit:
            break
    return records
