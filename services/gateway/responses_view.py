"""A chat stream's chunks as the Responses API's output items and events.

Items: a ``reasoning`` item (``--reasoning-parser``), the ``message`` with its
``output_text``, one ``function_call`` per tool call, each given its ``output_index`` when it
opens. Text items follow one another (a new one closes the last); a call stays open until
the next call opens or the response ends, so its argument fragments land however the chat
builder orders a delta's calls and text (it sends a delta's calls first, even where its text
came before them: that text is taken first when the delta opens the first call). Events are
snapshots, numbered from 0; the stream ends with ``response.completed`` /
``response.incomplete`` (``max_output_tokens``), or after an ``error`` event with
``response.failed``.
"""

from __future__ import annotations

import copy
import uuid
from typing import Any

from services.gateway.responses import Json

OUTPUT_TEXT: Json = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
REASONING_TEXT: Json = {"type": "reasoning_text", "text": ""}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesView:
    def __init__(self, response_id: str, created: int, model: str, echoed: Json) -> None:
        self.id, self.created, self.model, self.echoed = response_id, created, model, echoed
        self.items: list[Json] = []  # by output_index
        self.text: Json | None = None  # the open reasoning or message item
        self.calls: dict[int, Json] = {}  # the open function_call items, by the chat index
        self.sequence = 0
        self.status = "in_progress"
        self.incomplete: Json | None = None
        self.error: Json | None = None
        self.usage: Json | None = None

    def event(self, kind: str, **fields: Any) -> Json:
        """One event, a snapshot: the items it shows go on changing until it is sent."""
        event = {"type": kind, "sequence_number": self.sequence, **copy.deepcopy(fields)}
        self.sequence += 1
        return event

    def opening(self) -> list[Json]:
        snapshot = self.response()
        return [
            self.event("response.created", response=snapshot),
            self.event("response.in_progress", response=snapshot),
        ]

    def add(self, chunks: list[Json]) -> list[Json]:
        """The events of one delta's chat chunks (the role's opening chunk brings none)."""
        deltas = [c["choices"][0] for c in chunks if c.get("choices")]
        calls = [d for d in deltas if (d.get("delta") or {}).get("tool_calls")]
        texts = [d for d in deltas if d not in calls]
        opens = any(c.get("id") for d in calls for c in d["delta"]["tool_calls"])
        if opens and not self.calls:  # (its text came before its first call)
            deltas = texts + calls
        events: list[Json] = []
        for choice in deltas:
            delta = choice.get("delta") or {}
            if delta.get("reasoning"):
                events += self.add_text("reasoning", delta["reasoning"])
            for call in delta.get("tool_calls") or []:
                events += self.add_call(call)
            if delta.get("content"):
                entries = (choice.get("logprobs") or {}).get("content") or []
                events += self.add_text("message", delta["content"], entries)
            if choice.get("finish_reason") is not None:
                self.finish(choice["finish_reason"])
        return events

    def add_text(self, kind: str, delta: str, logprobs: list[Json] | None = None) -> list[Json]:
        """Reasoning or answer text, into the open text item of its kind (opened if need
        be: a new text item closes the last one); an answer's tokens' ``logprobs`` (chat's
        entries, the Responses shape: token, logprob, bytes, top_logprobs) with it."""
        events = []
        if self.text is None or self.text["type"] != kind:
            events += self.close_text()
            if kind == "reasoning":
                item: Json = {"id": new_id("rs"), "type": "reasoning", "summary": []}
                part = REASONING_TEXT
            else:
                item = {"id": new_id("msg"), "type": "message", "role": "assistant"}
                part = OUTPUT_TEXT
            item |= {"content": [], "status": "in_progress"}
            events.append(self.open_item(item))
            self.text = item
            item["content"].append(copy.deepcopy(part))
            events.append(
                self.event("response.content_part.added", **where(item), content_index=0, part=part)
            )
        item = self.text
        assert item is not None
        item["content"][0]["text"] += delta
        name = (
            "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        )
        extra: Json = {} if kind == "reasoning" else {"logprobs": logprobs or []}
        if logprobs:
            item["content"][0]["logprobs"] += logprobs
        events.append(self.event(name, **where(item), content_index=0, delta=delta, **extra))
        return events

    def add_call(self, call: Json) -> list[Json]:
        """A tool call's fragment: its first (with the call's id) opens a ``function_call``
        item, closing the calls before it (they are complete: the model started another)."""
        events = []
        function = call.get("function") or {}
        index = int(call.get("index", 0))
        if call.get("id"):
            events += self.close_text()
            for other in list(self.calls):
                events += self.close_call(other)
            item = {
                "id": new_id("fc"),
                "type": "function_call",
                "call_id": call["id"],
                "name": function.get("name", ""),
                "arguments": "",
                "status": "in_progress",
            }
            events.append(self.open_item(item))
            self.calls[index] = item
        fragment = function.get("arguments") or ""
        target = self.calls.get(index)
        if target is not None and fragment:
            target["arguments"] += fragment
            events.append(
                self.event(
                    "response.function_call_arguments.delta", **where(target), delta=fragment
                )
            )
        return events

    def open_item(self, item: Json) -> Json:
        item["output_index"] = len(self.items)  # (taken out of the item when it is shown)
        self.items.append(item)
        return self.event("response.output_item.added", output_index=item["output_index"],
                          item=shown(item))  # fmt: skip

    def close_text(self) -> list[Json]:
        item, self.text = self.text, None
        if item is None:
            return []
        item["status"] = self.closed_status()
        part = item["content"][0]
        done = "response.reasoning_text.done" if item["type"] == "reasoning" else (
            "response.output_text.done"
        )  # fmt: skip
        extra: Json = {} if item["type"] == "reasoning" else {"logprobs": part["logprobs"]}
        return [
            self.event(done, **where(item), content_index=0, text=part["text"], **extra),
            self.event("response.content_part.done", **where(item), content_index=0, part=part),
            self.event("response.output_item.done", output_index=item["output_index"],
                       item=shown(item)),
        ]  # fmt: skip

    def close_call(self, index: int) -> list[Json]:
        item = self.calls.pop(index)
        item["status"] = self.closed_status()
        return [
            self.event("response.function_call_arguments.done", **where(item),
                       name=item["name"], arguments=item["arguments"]),
            self.event("response.output_item.done", output_index=item["output_index"],
                       item=shown(item)),
        ]  # fmt: skip

    def close_all(self) -> list[Json]:
        events = self.close_text()
        for index in list(self.calls):
            events += self.close_call(index)
        return events

    def closed_status(self) -> str:
        """An item cut off (max_output_tokens, a failure) is incomplete, as OpenAI marks it."""
        return "completed" if self.status in ("in_progress", "completed") else "incomplete"

    def finish(self, reason: str) -> None:
        if reason == "length":
            self.status, self.incomplete = "incomplete", {"reason": "max_output_tokens"}
        else:
            self.status = "completed"

    def closing(self, usage: Json) -> list[Json]:
        self.usage = responses_usage(usage)
        if self.status == "in_progress":
            self.status = "completed"
        kind = "response.incomplete" if self.status == "incomplete" else "response.completed"
        return [*self.close_all(), self.event(kind, response=self.response())]

    def failing(
        self, code: str | None, message: str, param: str | None, status: int = 500
    ) -> list[Json]:
        """A stage failed mid-stream: the ``error`` event (its own code), the open items
        closed as incomplete, and ``response.failed`` (whose error codes are OpenAI's few)."""
        self.status = "failed"
        kind = "rate_limit_exceeded" if status == 429 else (
            "invalid_prompt" if 400 <= status < 500 else "server_error"
        )  # fmt: skip
        self.error = {"code": kind, "message": message}
        error = self.event("error", code=code, message=message, param=param)
        return [error, *self.close_all(), self.event("response.failed", response=self.response())]

    def response(self) -> Json:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": self.status,
            "background": False,
            "error": self.error,
            "incomplete_details": self.incomplete,
            "model": self.model,
            "output": [shown(item) for item in self.items],
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,
            "truncation": "disabled",
            "usage": self.usage,
            **self.echoed,
        }


def where(item: Json) -> Json:
    return {"item_id": item["id"], "output_index": item["output_index"]}


def shown(item: Json) -> Json:
    return {k: v for k, v in item.items() if k != "output_index"}


def responses_usage(usage: Json) -> Json:
    """Chat's usage in the Responses names."""
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
            "cache_write_tokens": 0,
        },
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }
