"""Plain records passed between the stages (a rendered prompt, an engine result, a checked outcome) and the words
they carry: a pass's stage, and why a row failed."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

# Fed to an engine instead of a prompt when none is ready yet (a replica waiting for its next unit): the engine
# keeps stepping what it has in flight and asks again.
WAIT: Any = type("Wait", (), {"__repr__": lambda self: "WAIT"})()


class Stage(StrEnum):
    """A pass's one identity: its rows' `Prompt.stage`, its queue's pairs, its commit records and the prefix of its
    part names ("p1-<unit>.parquet"). A str, so it reads back from JSON as it was written; its labels derive from
    it."""

    FIRST = "p1"
    SECOND = "p2"
    """The fallback pass: pass 1's retryable failures, sampled and without a draft."""

    @property
    def number(self) -> int:
        """1 or 2: the `_pass` column of output and rejects."""
        return list(Stage).index(self) + 1

    @property
    def label(self) -> str:
        """"pass1" or "pass2": the pass's name in the report and the progress bars."""
        return f"pass{self.number}"


# Why a row did not make it into the output; these codes appear unchanged in rejects and the report.
Reason = Literal["truncated", "repetition", "json_parse", "schema", "engine_error",
                 "prompt_too_long", "empty_prompt", "invalid_input", "duplicate_id"]
# Failures of the row's input, which no pass with this model can fix: they go straight to rejects. Every other
# reason is retryable: the row goes to the next pass (sampled, without a draft), if there is one.
FINAL: frozenset[Reason] = frozenset({"empty_prompt", "invalid_input", "prompt_too_long", "duplicate_id"})


@dataclass(slots=True)
class Prompt:
    """One row on its way to the engine: its id, the unit of work it belongs to, the chat-rendered text, and the
    pass it is in (Stage.SECOND for a row that failed pass 1): the engine decodes it with that pass's settings."""

    row_id: str
    unit: str
    text: str
    extra: dict[str, Any] = field(default_factory=dict)  # pass-through column values
    stage: Stage = Stage.FIRST


@dataclass(slots=True)
class Generation:
    """What the engine made of one prompt. `error` is set when the engine refused or failed the request."""

    prompt: Prompt
    text: str = ""
    finish_reason: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: Reason | None = None
    detail: str = ""
    candidates: list[Generation] = field(default_factory=list)
    """With n > 1 candidates per row: each of them, in the engine's order (this record then holds the first one's
    text and the tokens of all of them); empty with one candidate."""


@dataclass(slots=True)
class Outcome:
    """A checked generation: `value` is the parsed JSON when valid, else `reason` and `detail` say why not."""

    generation: Generation
    value: Any = None
    reason: Reason | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.reason is None
