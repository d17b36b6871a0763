"""E-mail bodies: strip headers, quoted replies, forwarded blocks, signatures and list footers.

A curation step for corpora of e-mail-like text (mailing-list archives, support threads, the
SpamAssassin corpus), run before the quality filters: what those filters should judge is the
text the writer wrote, not the transport headers or the earlier messages the reply quotes.
In a recipe (``params/curation.yaml``)::

    email_dedup_gopher:
      steps: [{email_body: {keep_subject: true}}, {exact_dedup: {}}, {gopher_quality: {}}, ...]

What goes, in order (each part can be switched off in :class:`EmailBodyConfig`):

* the RFC 5322 (822) header block at the top — an optional mbox ``From `` line, then ``Name:
  value`` fields and their folded continuation lines, up to the first blank line. A block counts
  as headers only when every line is header-shaped and one field is a common mail field (``From``,
  ``To``, ``Subject``, ``Date``, ``Received``, ...), so prose that opens with ``Note: ...`` stays.
  ``keep_subject`` puts the (RFC 2047-decoded) subject first in the body.
* MIME: when the headers declare a multipart or encoded body, the body is the message's decoded
  ``text/plain`` parts (the standard library's parser); a message with none (HTML only, say) is
  dropped as ``email_body.no_plain_text``.
* quoted replies: lines starting with ``>`` (or Supercite's ``Name>``) and the attribution line before them (``On <date>,
  <name> wrote:``, also folded over two lines, or ``<name> wrote:`` right before a quote);
* forwarded and original-message blocks: from a ``---- Forwarded message ----``, ``-----Original
  Message-----`` or ``Begin forwarded message:`` line to the end;
* the signature: from the RFC 3676 delimiter line ``-- `` to the end;
* mailing-list footers: from a line of underscores followed within three lines by ``mailing list``,
  ``listinfo`` or ``unsubscribe`` to the end.

A message left with no text is dropped as ``email_body.empty``. The step's stats count the
documents that had headers or MIME bodies and the lines and characters removed, per kind
(summed over shards by the sharded engine).
"""

from __future__ import annotations

import email
import email.policy
import re
from dataclasses import dataclass
from email.header import decode_header, make_header

import polars as pl

from tasks.curation.filters import FilterResult

#: Every reason the step returns.
EMAIL_RULES = ("empty", "no_plain_text")

# RFC 5322 field name: printable ASCII but the colon, then the colon.
_FIELD = re.compile(r"([!-9;-~]+):")
_MBOX_FROM = re.compile(r"From \S+")
_FOLDED = re.compile(r"[ \t]+\S")
#: Field names of which one must appear for a block to count as mail headers.
MAIL_FIELDS = frozenset({
    "from", "to", "cc", "bcc", "subject", "date", "received", "message-id", "return-path", "delivered-to",
    "reply-to", "sender", "in-reply-to", "references", "mime-version", "content-type", "x-mailer",
})
# ">" quoting, and Supercite's "Name>" (Emacs mail readers)
_QUOTE = re.compile(r"\s*(?:>|[A-Za-z][\w.-]{0,9}>(?:\s|$))")
_ATTRIBUTION = re.compile(r"\s*On\b.{0,300}\b(?:wrote|writes):\s*$", re.IGNORECASE)
_WROTE = re.compile(r".{0,200}\b(?:wrote|writes):\s*$", re.IGNORECASE)
_FORWARD = re.compile(
    r"\s*(?:-{2,}\s*(?:Original Message|Forwarded message|Forwarded by\b.*)\s*-{2,}|Begin forwarded message:)\s*$",
    re.IGNORECASE,
)
_SIGNATURE = re.compile(r"-- ?")
_UNDERSCORES = re.compile(r"\s*_{10,}\s*")
_FOOTER_HINT = re.compile(r"mailing list|listinfo|unsubscribe", re.IGNORECASE)
_BLANK_RUNS = re.compile(r"\n{3,}")


@dataclass(frozen=True, kw_only=True)
class EmailBodyConfig:
    """What :func:`email_body` strips; every part is on by default, ``keep_subject`` off."""

    headers: bool = True
    keep_subject: bool = False
    mime: bool = True
    quotes: bool = True
    forwarded: bool = True
    signature: bool = True
    list_footer: bool = True


def split_headers(lines: list[str]) -> tuple[dict[str, str], int]:
    """The header fields at the top of a message's ``lines`` (lower-cased names, folded values
    unfolded; a repeated field keeps its first value) and the number of lines they take, the
    blank line after them included; ``({}, 0)`` when the top is not a mail header block."""
    fields: dict[str, str] = {}
    last = None
    i = 1 if lines and _MBOX_FROM.match(lines[0]) else 0
    while i < len(lines) and lines[i].strip():
        line = lines[i]
        m = _FIELD.match(line)
        if m:
            last = m.group(1).lower()
            fields.setdefault(last, line[m.end():].strip())
        elif last is not None and _FOLDED.match(line):
            if fields.get(last) is not None and line.strip():
                fields[last] = f"{fields[last]} {line.strip()}".strip()
        else:
            return {}, 0
        i += 1
    if not MAIL_FIELDS.intersection(fields):
        return {}, 0
    return fields, min(i + 1, len(lines))


def _decoded(value: str) -> str:
    """An RFC 2047 header value (``=?utf-8?q?...?=``) as text; the raw value when it does not decode."""
    try:
        return str(make_header(decode_header(value)))
    except (ValueError, LookupError, UnicodeError):
        return value


def _mime_plain_text(text: str) -> str | None:
    """The decoded ``text/plain`` parts of a MIME message (blank-line separated), None when it has none."""
    msg = email.message_from_string(text, policy=email.policy.default)
    parts = []
    for part in msg.walk():
        if part.get_content_type() != "text/plain" or part.is_attachment():
            continue
        try:
            parts.append(part.get_content())
        except (LookupError, UnicodeError, ValueError, AssertionError):  # unknown charset, bad encoding
            payload = part.get_payload(decode=True) or b""
            parts.append(payload.decode("utf-8", errors="replace"))
    return "\n\n".join(p.strip("\n") for p in parts) if parts else None


def _cut_at(lines: list[str], pred) -> tuple[list[str], int]:
    """``lines`` up to the first line where ``pred(lines, i)`` holds, and how many were cut."""
    for i in range(len(lines)):
        if pred(lines, i):
            return lines[:i], len(lines) - i
    return lines, 0


def _is_footer(lines: list[str], i: int) -> bool:
    return bool(_UNDERSCORES.fullmatch(lines[i])) and any(_FOOTER_HINT.search(ln) for ln in lines[i + 1:i + 4])


def _strip_quotes(lines: list[str]) -> tuple[list[str], int, int]:
    """Lines without quoted ones and their attribution lines; returns (lines, quoted, attribution)."""
    quoted = [bool(_QUOTE.match(ln)) for ln in lines]
    drop_attr = [False] * len(lines)
    for i, line in enumerate(lines):
        if quoted[i]:
            continue
        if _ATTRIBUTION.match(line):
            drop_attr[i] = True
        elif i + 1 < len(lines) and line.lstrip().startswith("On ") and _WROTE.match(lines[i + 1]) \
                and not quoted[i + 1]:
            drop_attr[i] = drop_attr[i + 1] = True  # "On Thu, 22 Aug 2002, Jane Doe" / "<jane@x.org> wrote:"
        elif _WROTE.match(line):
            nxt = next((j for j in range(i + 1, len(lines)) if lines[j].strip()), None)
            drop_attr[i] = nxt is not None and quoted[nxt]
    kept = [ln for ln, q, a in zip(lines, quoted, drop_attr) if not (q or a)]
    return kept, sum(quoted), sum(drop_attr)


def clean_email(text: str, cfg: EmailBodyConfig = EmailBodyConfig()) -> tuple[str | None, str | None, dict[str, int]]:
    """One message's body: ``(body, reason, counters)``. ``body`` is None when the message is
    dropped, ``reason`` then says why (``email_body.<rule>``, :data:`EMAIL_RULES`)."""
    counts: dict[str, int] = {}
    lines = text.replace("\r\n", "\n").replace("\r", "\n").rstrip().split("\n")
    subject = None
    if cfg.headers:
        fields, n = split_headers(lines)
        if n:
            counts["docs_with_headers"] = 1
            counts["header_lines"] = n
            subject = _decoded(fields.get("subject", "")) or None
            ctype = fields.get("content-type", "").lower()
            encoding = fields.get("content-transfer-encoding", "").lower()
            if cfg.mime and (ctype.startswith(("multipart/", "text/html")) or encoding in ("base64", "quoted-printable")):
                counts["mime_docs"] = 1
                plain = _mime_plain_text("\n".join(lines))
                if plain is None:
                    return None, "email_body.no_plain_text", counts
                lines = plain.replace("\r\n", "\n").rstrip().split("\n")
            else:
                lines = lines[n:]
    if cfg.forwarded:
        lines, cut = _cut_at(lines, lambda ls, i: bool(_FORWARD.match(ls[i])))
        counts["forwarded_lines"] = cut
    if cfg.signature:
        lines, cut = _cut_at(lines, lambda ls, i: bool(_SIGNATURE.fullmatch(ls[i])))
        counts["signature_lines"] = cut
    if cfg.list_footer:
        lines, cut = _cut_at(lines, _is_footer)
        counts["footer_lines"] = cut
    if cfg.quotes:
        lines, quoted, attribution = _strip_quotes(lines)
        counts["quote_lines"] = quoted
        counts["attribution_lines"] = attribution
    body = _BLANK_RUNS.sub("\n\n", "\n".join(ln.rstrip() for ln in lines)).strip()
    if not body:
        return None, "email_body.empty", counts
    if cfg.keep_subject and subject:
        body = f"{subject}\n\n{body}"
    return body, None, counts


def email_body(texts: pl.Series, cfg: EmailBodyConfig = EmailBodyConfig()) -> FilterResult:
    """:func:`clean_email` over documents: the edited texts, a reason per dropped document, and
    the step's counters (``docs_with_headers``, ``mime_docs``, ``<kind>_lines`` removed per kind,
    ``chars_removed`` from the documents kept). Null documents count as ``""``.

    >>> email_body(pl.Series(["From: a@b.org\\nSubject: hi\\n\\nSee you at 5.\\n-- \\nAnn"])).texts.to_list()
    ['See you at 5.']
    """
    reasons: list[str | None] = []
    out: list[str | None] = []
    stats = dict.fromkeys(("docs_with_headers", "mime_docs", "header_lines", "quote_lines", "attribution_lines",
                           "forwarded_lines", "signature_lines", "footer_lines", "chars_removed"), 0)
    for text in texts.cast(pl.Utf8).fill_null("").to_list():
        body, reason, counts = clean_email(text, cfg)
        for k, v in counts.items():
            stats[k] += v
        reasons.append(reason)
        out.append(text if body is None else body)  # a dropped document keeps its original text
        if body is not None:
            stats["chars_removed"] += len(text) - len(body)
    return FilterResult(reasons=pl.Series(reasons, dtype=pl.Utf8), texts=pl.Series(out, dtype=pl.Utf8), stats=stats)


#: Steps of this module a recipe accepts: name -> (config class, function).
EMAIL_STEPS = {"email_body": (EmailBodyConfig, email_body)}
