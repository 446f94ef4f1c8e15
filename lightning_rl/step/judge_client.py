"""A minimal asynchronous client for an OpenAI-compatible chat endpoint: ``POST {base_url}/chat/completions``
on the standard library only (``asyncio`` streams): one connection per request, a deadline on the whole
exchange, and retries with exponential backoff on what may pass (connection refused or reset, a timeout, HTTP
429 and 5xx). Everything else (HTTP 4xx, an answer that is not the chat-completions JSON) fails at once.
Used by :class:`lightning_rl.step.judge.LLMJudge`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


class JudgeError(RuntimeError):
    """The judge could not score a sample: no answer after the retries, an HTTP error, or an answer whose
    score cannot be read. A reward function returns it in the sample's place (counted under
    ``model.rewards.on_error``). ``attempts``: the requests it cost."""

    attempts: int = 0


class Retryable(JudgeError):
    """A failure that may pass: the connection, a timeout, HTTP 429 or 5xx."""


@dataclass(frozen=True)
class Reply:
    """The text the model answered, the attempts it took and the seconds of the successful one."""

    text: str
    attempts: int
    seconds: float


async def post_json(url: str, payload: dict[str, Any], headers: dict[str, str],
                    timeout: float) -> tuple[int, bytes]:
    """``(status, body)`` of one HTTP/1.1 POST of ``payload`` as JSON, within ``timeout`` seconds."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise JudgeError(f"the judge's `base_url` must be an http(s) URL, got {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    context = ssl.create_default_context() if parts.scheme == "https" else None
    body = json.dumps(payload).encode()
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    lines = [f"POST {path} HTTP/1.1", f"Host: {parts.netloc}", "Content-Type: application/json",
             "Accept: application/json", f"Content-Length: {len(body)}", "Connection: close",
             *(f"{k}: {v}" for k, v in headers.items())]

    async def exchange() -> tuple[int, bytes]:
        reader, writer = await asyncio.open_connection(parts.hostname, port, ssl=context)
        try:
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
            await writer.drain()
            return await read_response(reader)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    return await asyncio.wait_for(exchange(), timeout)


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """Status and body of an HTTP/1.1 response (``Content-Length``, chunked, or to the connection's end)."""
    status_line = (await reader.readline()).decode("latin-1")
    fields = status_line.split()
    if len(fields) < 2 or not fields[0].startswith("HTTP/") or not fields[1].isdigit():
        raise JudgeError(f"the judge's endpoint did not answer HTTP: {status_line[:80]!r}")
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        key, _, value = line.decode("latin-1").partition(":")
        headers[key.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        data = b""
        while size := int((await reader.readline()).split(b";")[0].strip() or b"0", 16):
            data += await reader.readexactly(size)
            await reader.readline()
        return int(fields[1]), data
    if "content-length" in headers:
        return int(fields[1]), await reader.readexactly(int(headers["content-length"]))
    return int(fields[1]), await reader.read()


def answer_text(status: int, body: bytes) -> str:
    """The first choice's message content of a chat-completions answer; raises ``Retryable`` on 429 / 5xx,
    ``JudgeError`` on any other failure."""
    if status == 429 or status >= 500:
        raise Retryable(f"the judge's endpoint answered HTTP {status}: {body[:200]!r}")
    if status != 200:
        raise JudgeError(f"the judge's endpoint answered HTTP {status}: {body[:200]!r}")
    try:
        content = json.loads(body)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError) as err:
        raise JudgeError(f"the judge's answer is not chat-completions JSON ({type(err).__name__}): "
                         f"{body[:200]!r}") from err
    return content if isinstance(content, str) else json.dumps(content)


async def chat(base_url: str, payload: dict[str, Any], headers: dict[str, str], *, timeout: float,
               retries: int, backoff: float) -> Reply:
    """The model's answer to ``payload`` (a chat-completions request), after up to ``retries`` retries of
    what may pass, ``backoff * 2**i`` seconds apart; raises ``JudgeError`` naming the last failure."""
    url = base_url.rstrip("/") + "/chat/completions"
    for attempt in range(retries + 1):
        start = time.perf_counter()
        try:
            status, body = await post_json(url, payload, headers, timeout)
            return Reply(answer_text(status, body), attempt + 1, time.perf_counter() - start)
        except Retryable as err:
            last: Exception = err
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as err:
            last = Retryable(f"{type(err).__name__}: {err}" if str(err) else type(err).__name__)
            if isinstance(err, asyncio.TimeoutError):
                last = Retryable(f"no answer within {timeout} s")
        except JudgeError as err:  # not worth retrying
            err.attempts = attempt + 1
            raise
        if attempt < retries:
            await asyncio.sleep(backoff * 2**attempt)
    failed = JudgeError(f"{url}: {last} (after {retries + 1} attempts)")
    failed.attempts = retries + 1
    raise failed
