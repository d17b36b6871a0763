"""The e-mail step: headers, MIME, quoted replies, forwarded blocks, signatures and list footers go;
what the writer wrote stays; messages left empty are dropped with their own reason."""

from __future__ import annotations

import polars as pl
import pytest

from tasks.curation.mail import EmailBodyConfig, clean_email, email_body
from tasks.curation.recipes import Recipe, run_recipe, step
from tasks.curation.sharded import curate_corpus

# A mailing-list reply as it sits in an mbox archive: envelope line, folded Received headers,
# an RFC 2047 subject, an attribution folded over two lines, quoted text, a signature and the
# list's footer.
REPLY = """From exmh-workers-admin@redhat.com  Thu Aug 22 12:36:23 2002
Return-Path: <exmh-workers-admin@example.com>
Received: from listman.example.com (localhost [127.0.0.1]) by
    listman.example.com (Postfix) with ESMTP id 8386540858; Thu, 22 Aug 2002
    07:35:02 -0400 (EDT)
From: Chris Garrigues <cwg@example.com>
To: Robert Elz <kre@example.org>
Subject: =?utf-8?q?Re=3A_New_Sequences_Window_=E2=80=94_again?=
Date: Thu, 22 Aug 2002 07:34:10 -0500
Message-Id: <1029945287.4797.TMDA@deepeddy.example.com>

On Wed, 21 Aug 2002 23:22:27 +0700, Robert Elz
<kre@example.org> wrote:
> I can't reproduce this error.
>
> For me it is very repeatable.

I think I found the problem: the sequence cache was never flushed.
The patch is in CVS now.

-- 
Chris Garrigues                 http://www.example.com/cwg/
Austin, TX

_______________________________________________
Exmh-workers mailing list
https://listman.example.com/mailman/listinfo/exmh-workers
"""

OUTLOOK_FORWARD = """From: Ann Lee <ann@example.com>
To: team@example.com
Subject: FW: budget

Numbers for the meeting are below.
Dan wrote:

> earlier thread

-----Original Message-----
From: Dan <dan@example.com>
Sent: Monday, March 4, 2002 9:12 AM
Subject: budget

The budget is attached.
"""

GMAIL_FORWARD = """Subject: Fwd: trip
From: bo@example.com

Look at this.

---------- Forwarded message ---------
From: Travel <noreply@example.com>
Your trip is confirmed.
"""

ONLY_QUOTED = """From: Bo <bo@example.com>
Subject: Re: lunch

On Mon, Mar 4, 2002 at 9:12 AM Ann <ann@example.com> wrote:
> shall we meet at noon?
"""

PLAIN_PROSE = """Note: this is not an e-mail.
It starts with a colon-word line: the header test must leave it alone.
"""

MULTIPART = """From: Shop <shop@example.com>
To: you@example.com
Subject: Sale
MIME-Version: 1.0
Content-Type: multipart/alternative; boundary="XX"

This is a multi-part message in MIME format.
--XX
Content-Type: text/plain; charset="utf-8"
Content-Transfer-Encoding: quoted-printable

Our caf=C3=A9 opens on Monday.
--XX
Content-Type: text/html; charset="utf-8"

<html><body><p>Our caf&eacute; opens on Monday.</p></body></html>
--XX--
"""

HTML_ONLY = """From: Spam <spam@example.com>
Subject: WIN
Content-Type: text/html; charset="us-ascii"

<html><body><b>You have won!</b></body></html>
"""


def test_a_list_reply_keeps_only_what_its_writer_wrote():
    body, reason, counts = clean_email(REPLY)
    assert reason is None
    assert body == ("I think I found the problem: the sequence cache was never flushed.\n"
                    "The patch is in CVS now.")
    assert counts["header_lines"] == 11  # the envelope line, 9 header lines, the blank line
    assert counts["quote_lines"] == 3 and counts["attribution_lines"] == 2
    assert counts["signature_lines"] == 7  # from "-- " to the end (the footer came after it)


def test_keep_subject_puts_the_decoded_subject_first():
    body, _, _ = clean_email(REPLY, EmailBodyConfig(keep_subject=True))
    assert body.startswith("Re: New Sequences Window — again\n\nI think I found the problem")


def test_each_part_can_be_kept():
    body, _, _ = clean_email(REPLY, EmailBodyConfig(headers=False, quotes=False, signature=False, list_footer=False))
    assert body == REPLY.strip().replace("\n-- \n", "\n--\n")  # trailing spaces go
    body, _, counts = clean_email(REPLY, EmailBodyConfig(signature=False))
    assert "Austin, TX" in body and "mailing list" not in body and counts["footer_lines"] == 3


def test_supercite_quotes_go_and_comparisons_stay():
    body, _, counts = clean_email("Greg> It just requires this\n    Greg>   package_dir = {}\n\n"
                                  "That has a side effect.\nif x>0 and y>1: keep this line")
    assert body == "That has a side effect.\nif x>0 and y>1: keep this line" and counts["quote_lines"] == 2


def test_forwarded_and_original_message_blocks_are_cut():
    body, _, counts = clean_email(OUTLOOK_FORWARD)
    assert body == "Numbers for the meeting are below."  # "Dan wrote:" before a quote goes too
    assert counts["forwarded_lines"] == 6 and counts["attribution_lines"] == 1
    body, _, _ = clean_email(GMAIL_FORWARD)
    assert body == "Look at this."


def test_prose_that_opens_with_a_colon_word_is_not_a_header():
    body, reason, counts = clean_email(PLAIN_PROSE)
    assert reason is None and body == PLAIN_PROSE.strip() and "docs_with_headers" not in counts


def test_mime_bodies_keep_their_decoded_plain_text_part():
    body, reason, counts = clean_email(MULTIPART)
    assert reason is None and counts["mime_docs"] == 1
    assert body == "Our café opens on Monday."
    assert clean_email(HTML_ONLY)[1] == "email_body.no_plain_text"


def test_step_reasons_texts_and_counters():
    texts = pl.Series([REPLY, ONLY_QUOTED, HTML_ONLY, None, PLAIN_PROSE])
    res = email_body(texts, EmailBodyConfig())
    assert res.reasons.to_list() == [None, "email_body.empty", "email_body.no_plain_text", "email_body.empty", None]
    assert res.texts[1] == ONLY_QUOTED  # a dropped document keeps its original text
    assert res.stats["docs_with_headers"] == 3 and res.stats["quote_lines"] == 4
    assert res.stats["chars_removed"] == len(REPLY) - len(res.texts[0]) + len(PLAIN_PROSE) - len(res.texts[4])


def _mail_corpus() -> pl.DataFrame:
    """The same message delivered to two lists (other headers, same body), an empty reply, prose."""
    second = REPLY.replace("exmh-workers-admin@redhat.com", "other-list@example.net").replace("8386540858", "1")
    texts = [REPLY, ONLY_QUOTED, second, PLAIN_PROSE, HTML_ONLY, GMAIL_FORWARD]
    return pl.DataFrame({"id": [f"m{i}" for i in range(len(texts))], "text": texts})


def test_in_a_recipe_before_dedup_the_stripped_copies_are_duplicates():
    docs = _mail_corpus()
    assert docs["text"].n_unique() == docs.height  # raw, no two messages are equal
    recipe = Recipe(steps=(step("email_body"), step("exact_dedup")))
    res = run_recipe(docs, recipe)
    assert res.stats["dropped_by_reason"] == {"email_body.empty": 1, "email_body.no_plain_text": 1,
                                              "exact_dedup.duplicate": 1}
    assert res.kept["id"].to_list() == ["m0", "m3", "m5"]
    assert res.stats["docs_in"] == res.stats["docs_kept"] + res.stats["docs_dropped"]
    email_step = res.stats["steps"][0]
    assert email_step["step"] == "email_body" and email_step["docs_out"] == 4
    assert email_step["docs_with_headers"] == 5 and email_step["chars_removed"] > 0


@pytest.mark.parametrize("n_workers", [1])
def test_sharded_engine_sums_the_step_counters_like_the_in_memory_recipe(tmp_path, n_workers):
    docs = _mail_corpus()
    src = tmp_path / "mail.parquet"
    docs.write_parquet(src)
    recipe = Recipe(steps=(step("email_body", keep_subject=True), step("exact_dedup")))
    stats = curate_corpus([src], tmp_path / "out", recipe, n_workers=n_workers, shard_docs=2)
    ref = run_recipe(docs, recipe)
    assert pl.read_parquet(tmp_path / "out" / "kept.parquet").drop("source")["text"].to_list() == ref.kept["text"].to_list()
    assert stats["steps"] == ref.stats["steps"]
    assert stats["dropped_by_reason"] == ref.stats["dropped_by_reason"]
