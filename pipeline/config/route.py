"""Which tier generates each item: rules, the learned router, escalation, and the output checks escalation reads."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, model_validator

from pipeline.config.base import Section


class RouteRule(Section):
    """A rule sends matching items to a tier; all the conditions given must hold. Rules are tried in order."""

    name: str = Field(description="Recorded as the item's `route_reason` (`rule:<name>`).")
    tier: str = Field(description="Tier the matching items go to.")
    min_chars: int | None = Field(None, ge=0, description="Text at least this many characters long.")
    max_chars: int | None = Field(None, ge=0, description="Text at most this many characters long.")
    tenants: list[str] = Field(default_factory=list, description="Tenant is one of these.")
    metadata: dict[str, Any] = Field(
        default_factory=dict, description="Every listed metadata field equals the value given."
    )
    regex: str | None = Field(None, description="Regular expression found in the text (Python syntax).")

    @model_validator(mode="after")
    def _regex_compiles(self) -> "RouteRule":
        if self.regex is not None:
            try:
                re.compile(self.regex)
            except re.error as e:
                raise ValueError(f"route rule {self.name!r}: regex does not compile: {e}") from None
        return self


class EscalationConfig(Section):
    """Generate-then-verify: a low-confidence output of a smaller tier is generated again on `to_tier`."""

    enabled: bool = Field(False, description="Escalate low-confidence outputs.")
    to_tier: str | None = Field(None, description="Tier escalations go to; unset: the largest tier.")
    min_mean_logprob: float | None = Field(
        -2.5,
        description=(
            "Outputs whose mean token log-probability (from vLLM) is below this are escalated; "
            "null: this signal is off (`tokenmill eval` picks it)."
        ),
    )
    on_truncation: bool = Field(
        True, description="Also escalate outputs cut off by `max_tokens` (finish reason `length`)."
    )
    on_unfaithful: bool = Field(
        False,
        description=(
            "Also escalate outputs that state numbers, dates or capitalised names their document "
            "does not contain (on the escalation tier itself they are flagged: ledger column "
            "`unfaithful`)."
        ),
    )
    on_degenerate: bool = Field(
        True,
        description="Also escalate outputs that fail the `degenerate` check "
        "(a repetition loop: `checks.degenerate_below`).",
    )
    on_copied: bool = Field(
        True,
        description="Also escalate outputs that fail the `copied` check "
        "(the document given back: `checks.copied_above`).",
    )
    on_off_topic: bool = Field(
        True,
        description=(
            "Also escalate outputs that fail the `off_topic` check (about something else than "
            "their document: `checks.off_topic_below`)."
        ),
    )


JUDGE_RUBRIC = (
    "You judge a summary of a document. Answer KEEP if a reader would keep it: it says what the document is "
    "about, states nothing the document does not say, does not repeat itself and is not the document or "
    "these instructions given back. Otherwise answer BAD. Answer with one word.\n\n"
    "Document:\n{document}\n\nSummary:\n{summary}\n\nAnswer (KEEP or BAD):"
)


class JudgeConfig(Section):
    """An LLM judge: a tier's model asked, per output, whether a reader would keep it (docs/judge-rubric.md), in
    jobs (generate/judge.py); `tokenmill checks calibrate --judge` measures its agreement with a reader's labels like
    any other check's."""

    tier: str = Field(description="The tier whose model judges (a strong one: a 135M model answers at random).")
    rubric: str = Field(
        JUDGE_RUBRIC,
        description=(
            "The judge's prompt, with `{document}` and `{summary}`; its answer's first word KEEP (or GOOD, YES) "
            "keeps the output, BAD (or NO) does not, anything else is no verdict."
        ),
    )
    max_tokens: int = Field(4, ge=1, description="Tokens the judge may answer with (a verdict is one word).")

    @model_validator(mode="after")
    def _placeholders(self) -> "JudgeConfig":
        missing = [p for p in ("{document}", "{summary}") if p not in self.rubric]
        if missing:
            raise ValueError(f"checks.judge.rubric must contain {' and '.join(missing)}")
        return self


class ChecksConfig(Section):
    """Output checks: the summaries a user would throw away, flagged per item (ledger columns `degenerate`,
    `copied`, `off_topic`), escalated when `route.escalation` is on, and quarantined if listed in `quarantine`.
    Defaults measured on this project's outputs (docs/data-engineer.md#output-checks)."""

    degenerate_below: float = Field(
        0.30,
        gt=0,
        le=1,
        description=(
            "An output whose zlib-compressed size (of the whole, or of its second half if lower) "
            "is under this share of its size is `degenerate` (a repetition loop); 339 standard-library "
            "docstrings of summary length measure 0.31 at the least, 0.60 at the median."
        ),
    )
    min_chars: int = Field(
        80,
        ge=1,
        description="Shorter outputs are never `degenerate` by `degenerate_below` (short text compresses badly).",
    )
    repetition_above: float = Field(
        0.30,
        ge=0,
        le=1,
        description=(
            "An output whose share of repeated word 3-grams (or 4-grams) is above this, or that says a "
            "sentence again (measure 1.0), is `degenerate` too: a repeat within 96 tokens that zlib misses."
        ),
    )
    copied_above: float = Field(
        0.50,
        ge=0,
        le=1,
        description=(
            "An output with more than this share of its 6-word runs found verbatim in its document "
            "is `copied` (the text given back, not summarised): the demo's copies of a document's "
            "opening measure 0.52-0.92."
        ),
    )
    min_words: int = Field(
        12, ge=6, description="Shorter outputs are never `copied` (a short summary may quote a title)."
    )
    prompt_echo_above: float = Field(
        0.0,
        ge=0,
        le=1,
        description=(
            "An output of which more than this share of characters is an instruction to summarise "
            '("Summarize the following document in a few sentences.") is `copied` too: the prompt given back.'
        ),
    )
    off_topic_below: float = Field(
        0.25,
        ge=0,
        le=1,
        description=(
            "An output of which less than this share of its topic words (content words of 4 letters "
            "or more, stemmed) appear in its document is `off_topic`. Of the demo's 24 real outputs "
            "that neither loop nor copy, the two below 0.25 are the invented topic (0.00) and "
            "a vague one (0.12); the next measures 0.39; the same outputs set against other documents "
            "measure under 0.25 in 77% of pairs. Against the labelled set's test half (2026-12-05): "
            "precision 0.14 (1 of 7), recall 0.33 (1 of 3): this model's wrong summaries stay on their "
            "document's words."
        ),
    )
    min_topic_words: int = Field(
        4, ge=1, description="Outputs with fewer topic words are never `off_topic` (too little to judge)."
    )
    unsupported_above: int | None = Field(
        None,
        ge=0,
        description=(
            "An output with more than this many topic words its document lacks in every form (content "
            'words of 4 letters or more, stemmed: an invented "refund" in a licence) is `unfaithful` too, '
            "besides the numbers, dates and names it states that the document lacks. Null: off."
        ),
    )
    unsupported_share_above: float | None = Field(
        None,
        ge=0,
        le=1,
        description=(
            "An output of which more than this share of its topic words its document lacks in every form is "
            "`unfaithful` too (the share, unlike `unsupported_above`'s count, does not grow with length). Null: off."
        ),
    )
    vague_below: int = Field(
        5,
        ge=0,
        description=(
            "An output that states fewer than this many of its document's topic words (content words of 4 "
            'letters or more, stemmed) is `vague`: it names its topic and says nothing of it ("The document '
            'is a summary of the setterm command."). Not `acceptable`; no ledger column of its own. 0: off.'
        ),
    )
    extract_min_words: int | None = Field(
        None,
        ge=0,
        description=(
            "A copied output that states at least this many of its document's topic words is an extract of the "
            "document's key sentences, which a reader keeps: not `copied`. Null: every copy is `copied`."
        ),
    )
    markup_above: float = Field(
        0.10,
        ge=0,
        le=1,
        description=(
            "An output of which more than this share of characters is markup lines (a code block, headings, "
            'a bracketed line, a flag or a label alone, "Files: a.md b.md") is flagged `markup`: the document\'s '
            "form given back, not a summary. Not `acceptable`; no ledger column of its own."
        ),
    )
    judge: JudgeConfig | None = Field(
        None,
        description=(
            "An optional LLM judge (a tier and a rubric) for deployments with a strong model: a job asks it about "
            "each output that passed every other check, as a follow-up wave on its tier (with route.escalation on, "
            "the escalation tier); an output it does not keep (BAD, or no verdict) is not `acceptable`, and its "
            "cost is a ledger row of kind `judge`. `tokenmill checks calibrate --judge` measures its agreement "
            "with labels. Null: none."
        ),
    )
    quarantine: list[Literal["degenerate", "copied", "off_topic"]] = Field(
        default_factory=list,
        description=(
            "Checks whose failure quarantines the record (reason: the check's name; its generations "
            "stay in the ledger, `kind` invalid_output) when the served output still fails after "
            "escalation, or was not escalated. Empty: such outputs are served and flagged."
        ),
    )


class RouteConfig(Section):
    default_tier: str = Field(description="Tier for items no rule or router decides.")
    rules: list[RouteRule] = Field(
        default_factory=list, description="Rules tried first, in order; the first that matches decides."
    )
    router: str | None = Field(
        None, description="Learned router artifact (`tokenmill router train`); decides items no rule matched."
    )
    escalation: EscalationConfig = Field(
        default_factory=EscalationConfig, description="Generate-then-verify escalation."
    )
    decided_by: str | None = Field(
        None,
        description=(
            "What chose this routing, with its figure, in one line (`tokenmill eval --update-config` writes it): "
            "`tokenmill run` prints it beside each tier's share, so a run that sends everything to one tier "
            "says why."
        ),
    )
    requested_model: Literal["tier", "route"] = Field(
        "tier",
        description=(
            "A batch request's `model`: `tier` runs it on the tier that serves that name (its name, its `model` or "
            "one of its `served_model_names`; another name is quarantined as `unknown_model`); `route`: the rules "
            "and the router decide, as for documents, and the name is only echoed in the answer."
        ),
    )
