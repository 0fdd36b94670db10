"""Redaction of secrets in URLs, for every error message and log line that shows one.

A URL a caller sends may carry credentials: userinfo (`https://user:password@host/...`) or a token
in the query (`?access_token=...`, a presigned `X-Amz-Signature=...`, an Azure `sig=...`). Neither
may come back in an error reply or reach a log. The rule:

* userinfo is replaced by `***` (`https://***@host/...`), so the message still says there was some;
* the value of every query parameter whose name looks like a secret (SECRET_PARAM) is replaced by `***`;
* a fragment is dropped (OAuth implicit flows put tokens there).

`redact_url` formats one URL for a message; `redact_text` applies the same rule to any text (an
exception's message, a log line, an access-log path), wherever URLs sit in it.
"""

from __future__ import annotations

import logging
import re

MASK = "***"
_MAX_URL_CHARS = 160  # a URL in a message is cut to this, so a long data: URI or path stays readable

# Parameter names that hold secrets: token, access_token, sig, signature, key, api_key, secret, password,
# auth, credential, session, jwt ... as a whole name or a _/-separated part of one, and the cloud
# presigning families (X-Amz-*, X-Goog-*, X-Ms-*) whole.
SECRET_PARAM = re.compile(
    r"(?:x-amz-|x-goog-|x-ms-).*"
    r"|(?:.*[_.-])?(?:token|tokens|sig|signature|key|apikey|secret|password|passwd|pwd|pass|auth|authorization"
    r"|credential|credentials|session|sessionid|jwt|code)(?:[_.-].*)?",
    re.IGNORECASE)
_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<userinfo>[^/?#\s'\"<>]*)@")  # to the last @
_QUERY_PARAM = re.compile(r"(?P<sep>[?&;])(?P<name>[^=&;#\s'\"<>?]+)=(?P<value>[^&;#\s'\"<>]*)")
_FRAGMENT = re.compile(r"(?P<url>\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>#]*)#[^\s'\"<>]*")


def is_secret_param(name: str) -> bool:
    """Whether a query parameter of this name holds a secret (see SECRET_PARAM)."""
    return SECRET_PARAM.fullmatch(name) is not None


def redact_text(text: str) -> str:
    """`text` with every URL's userinfo, secret query values and fragment masked (see the module rule)."""
    text = _USERINFO.sub(lambda m: f"{m['scheme']}{MASK}@", text)
    text = _QUERY_PARAM.sub(lambda m: f"{m['sep']}{m['name']}={MASK}" if is_secret_param(m["name"]) else m[0], text)
    return _FRAGMENT.sub(lambda m: m["url"], text)


def redact_url(url: str) -> str:
    """One URL as an error message may show it: redacted, and cut to a readable length."""
    shown = redact_text(url.split("#", 1)[0])
    return shown if len(shown) <= _MAX_URL_CHARS else shown[:_MAX_URL_CHARS - 3] + "..."


class RedactingFilter(logging.Filter):
    """Masks URL secrets in a record's message and arguments (install on a logger that logs URLs, such as
    uvicorn's access log, whose paths carry the query strings of signed links)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact_text(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(redact_text(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: redact_text(v) if isinstance(v, str) else v for k, v in record.args.items()}
        return True


class RedactingFormatter(logging.Formatter):
    """A formatter whose output (message, arguments and traceback alike) has URL secrets masked."""

    def format(self, record: logging.LogRecord) -> str:
        return redact_text(super().format(record))


def redact_loggers(*names: str) -> None:
    """Install a RedactingFilter on each logger named (once, however often it is called). A logger's filters
    do not apply to its children's records, so name each logger that logs URLs."""
    for name in names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactingFilter) for f in logger.filters):
            logger.addFilter(RedactingFilter())
