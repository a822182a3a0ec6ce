"""Conversations about an image: one `{"image": ..., "messages": [...]}` record → token ids and
labels for a vision-language run.

The messages go through the byte tokenizer's built-in chat template and chat.py's split into
the model's tokens (chat.conversation_ids: the same code the text SFT records use), with `<image>`
in a user turn standing for the image. Its 7 bytes are then swapped for the image's run of
placeholder ids, so the placeholders sit where the user put them (Qwen2-VL's processor expands
its image pad token the same way); without `<image>` the image opens the first user turn. Labels
(-100 elsewhere) are on the assistant turns and their end-of-turn byte, every turn of any number.

The swap happens after rendering because the placeholder id (255) is not a character: no UTF-8
text can hold it, which is also why a text byte is never mistaken for part of an image.
"""

from __future__ import annotations

from meshspeed.data.chat import conversation_ids, shifted_labels
from meshspeed.data.chat_template import ByteChatFormat
from meshspeed.data.corpus import DataError

IMAGE = "<image>"
_IMAGE_BYTES = IMAGE.encode()


def _with_image(messages: list, where: str) -> list:
    """The messages with exactly one IMAGE, in a user turn (added at the start of the first)."""
    found = [(i, m["role"]) for i, m in enumerate(messages) for _ in range(m["content"].count(IMAGE))]
    if len(found) > 1:
        raise DataError(
            f"{where}: 'messages' holds {IMAGE} {len(found)} times; one image per record is built, "
            f"so give one {IMAGE} (or none: the image then opens the first user turn)"
        )
    if found and found[0][1] != "user":
        raise DataError(
            f"{where}: {IMAGE} is in message {found[0][0]}, a {found[0][1]} turn; put it in a user turn"
        )
    if found:
        return messages
    first = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first is None:
        raise DataError(f"{where}: 'messages' has no user turn to hold the image; add one")
    out = [dict(m) for m in messages]
    out[first]["content"] = IMAGE + out[first]["content"]
    return out


def conversation_sequence(
    messages, where: str, n_image_tokens: int, image_token_id: int
) -> tuple[list[int], list[int]]:
    """(token ids, labels) of one conversation about one image (module docstring)."""
    fmt = ByteChatFormat()
    conversation_ids(fmt, {"messages": messages}, where)  # the shape, roles and turns, one line each
    msgs = _with_image(messages, where)
    ids, mask = conversation_ids(fmt, {"messages": msgs}, where)
    text = bytes(ids)
    at = text.find(_IMAGE_BYTES)
    if at < 0 or text.count(_IMAGE_BYTES) != 1:  # the byte template's headers hold no "<image>"
        raise DataError(f"{where}: the rendered conversation does not hold {IMAGE} once")
    n = len(_IMAGE_BYTES)
    ids = ids[:at] + [image_token_id] * n_image_tokens + ids[at + n :]
    mask = mask[:at] + [False] * n_image_tokens + mask[at + n :]
    return ids, shifted_labels(ids, mask)
