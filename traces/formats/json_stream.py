"""A JSON object read member by member, one of its arrays element by element, from a plain or gzip file: a PyTorch
profiler trace's `traceEvents` (10^6-10^7 events, GBs of text) reaches its reader one event at a time, so neither the
whole text nor a dict per event sits in memory (traces.formats.kineto keeps a compact tuple per event it uses).

    stream = ObjectStream(path, "traceEvents", lead={"schemaVersion", ...})
    stream.head        # the members before traceEvents (PyTorch writes schemaVersion, distributedInfo there)
    for ev in stream.items(): ...
    stream.members()   # head and the members after the array, once items() is exhausted

The text is decoded in chunks of CHUNK characters and each value parsed by the standard library's decoder
(json.JSONDecoder.raw_decode, its C scanner): the same values json.loads gives. A value cut by a chunk's end is
parsed again once the next chunk is in; a value that ends exactly at the buffer's end is too (a number may go on
in the next chunk). Errors are one TraceError line naming the file and where: damaged gzip, not UTF-8, invalid or
truncated JSON.
"""
from __future__ import annotations

import gzip
import io
import json
import zlib
from pathlib import Path
from typing import Any, Collection, Iterator

from traces.trace import TraceError

CHUNK = 1 << 22  # characters decoded at a time (4 MiB of ASCII): the buffer holds about one or two of them
MAX_VALUE = 1 << 28  # characters one value may span (a profiler event is < 1 KB): beyond, the file is damaged
_CUT = 16  # an error this close to the buffer's end may be the chunk's cut (`tru|e`, `\\u00|e9`)
TRUNCATED = "the file may be truncated (was the profiler stopped before it finished writing?)"
_WS = " \t\n\r"


class ObjectStream:
    """The top-level JSON object of `path`, read up to its member `array` (`head`), whose elements `items()`
    yields, and then to its end (`members()`). `head` is None when the file is not an object, its first member is
    not one of `lead` (then nothing more is read) or it has no member `array`: the caller reads it another way."""

    def __init__(self, path: str | Path, array: str, lead: Collection[str] | None = None, chunk: int | None = None):
        self.path, self.array, self.chunk = Path(path), array, chunk or CHUNK
        self._decoder = json.JSONDecoder()
        self._fh = _open_text(self.path)
        self._buf, self._pos, self._eof, self._consumed = "", 0, False, 0
        self._members: dict[str, Any] = {}
        self._lead = lead
        self._done = False
        self.head: dict[str, Any] | None = None
        try:
            if self._next_char() != "{":
                self.close()
                return
            self._pos += 1
            if self._read_members():  # stopped at the array
                self.head = dict(self._members)
            else:
                self.close()
        except TraceError:
            self.close()
            raise

    def items(self) -> Iterator[Any]:
        """The array's elements, in file order (once)."""
        if self.head is None or self._done:
            raise RuntimeError("ObjectStream.items(): no array to read (head is None) or read already")
        n = 0
        try:
            if self._next_char() != "[":
                raise TraceError(f"{self.path}: {self.array} is not a list; expected a JSON array of events")
            self._pos += 1
            if self._next_char() == "]":
                self._pos += 1
            else:
                while True:
                    yield self._value(f"{self.array}[{n}]")
                    n += 1
                    c = self._next_char()
                    self._pos += 1
                    if c == "]":
                        break
                    if c != ",":
                        raise self._error(f"expected ',' or ']' after {self.array}[{n - 1}]")
            self._done = True
        except GeneratorExit:
            self.close()
            raise
        except TraceError:
            self.close()
            raise

    def members(self) -> dict[str, Any]:
        """Every member but the array: the head and what follows the array (read now)."""
        if not self._done:
            raise RuntimeError("ObjectStream.members(): read items() to their end first")
        try:
            c = self._next_char()
            if c == ",":
                self._pos += 1
                self._read_members()
            elif c == "}":
                self._pos += 1
            else:
                raise self._error(f"expected ',' or '}}' after {self.array}")
            if self._next_char() != "":
                raise self._error("text after the top-level object")
        finally:
            self.close()
        return dict(self._members)

    def close(self) -> None:
        self._fh.close()

    # ---- the buffer ----------------------------------------------------------------------------------------------
    def _fill(self) -> bool:
        """Read the next chunk onto the buffer (dropping what was consumed); False at the end of the file."""
        if self._eof:
            return False
        try:
            more = self._fh.read(self.chunk)
        except (EOFError, OSError, zlib.error) as err:
            raise TraceError(f"{self.path}: gzip stream is damaged or truncated ({err}); re-copy or re-capture the "
                             "file") from None
        except UnicodeDecodeError:
            raise TraceError(f"{self.path}: not UTF-8 JSON text") from None
        if not more:
            self._eof = True
            return False
        self._consumed += self._pos
        self._buf = self._buf[self._pos:] + more
        self._pos = 0
        return True

    def _next_char(self) -> str:
        """The next character that is not white space, not consumed ('' at the end of the file)."""
        while True:
            buf, pos = self._buf, self._pos
            n = len(buf)
            while pos < n and buf[pos] in _WS:
                pos += 1
            self._pos = pos
            if pos < n:
                return buf[pos]
            if not self._fill():
                return ""

    def _value(self, what: str) -> Any:
        """Parse the value at the position and move past it."""
        self._next_char()
        while True:
            try:
                value, end = self._decoder.raw_decode(self._buf, self._pos)
            except json.JSONDecodeError as err:
                # cut by the buffer's end (the scanner stopped in its last characters: a literal, an escape, a
                # number's delimiter; or in a string not closed yet): parse again with the next chunk in. An error
                # inside the text is reported where it is, without reading the rest of a damaged file.
                cut = len(self._buf) - err.pos <= _CUT or err.msg.startswith("Unterminated string")
                if cut and len(self._buf) - self._pos < MAX_VALUE and self._fill():
                    continue
                raise self._error(f"{what}: {err.msg}", self._consumed + err.pos, truncated=cut) from None
            if end >= len(self._buf) and self._fill():  # a number may go on in the next chunk
                continue
            self._pos = end
            return value

    def _read_members(self) -> bool:
        """Read `"key": value` members up to the array's key (True: the position is at its value) or the object's
        end (False)."""
        if self._next_char() == "}":
            self._pos += 1
            return False
        while True:
            key = self._value("a member name")
            if not isinstance(key, str):
                raise self._error("a member name is not a string")
            if self._lead is not None and not self._members and key not in self._lead and key != self.array:
                return False  # not the file this stream is for: read no further
            if self._next_char() != ":":
                raise self._error(f"expected ':' after {key!r}")
            self._pos += 1
            if key == self.array and not self._done:
                return True
            self._members[key] = self._value(key)
            c = self._next_char()
            self._pos += 1
            if c == "}":
                return False
            if c != ",":
                raise self._error(f"expected ',' or '}}' after {key!r}")

    def _error(self, what: str, at: int | None = None, truncated: bool | None = None) -> TraceError:
        """`truncated`: the value ran into the end of the file (default: the position is at it)."""
        at = self._consumed + self._pos if at is None else at
        if truncated is None:
            truncated = len(self._buf) - (at - self._consumed) <= _CUT
        return TraceError(f"{self.path}: not valid JSON ({what}, at character {at:,}); "
                          + (TRUNCATED if truncated and self._eof else "the file is damaged"))


def _open_text(path: Path) -> _Closing:
    """The file as text, gzip or not, in its JSON encoding (json.detect_encoding of its first bytes)."""
    try:
        raw = path.open("rb")
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise TraceError(f"{path}: is a directory, expected a trace file") from None
    binary: Any = raw
    try:
        if raw.peek(2)[:2] == b"\x1f\x8b":
            binary = gzip.GzipFile(fileobj=raw)  # closing it leaves raw open: _Closing closes both
        head = binary.peek(4)[:4]
    except (EOFError, OSError, zlib.error) as err:
        raw.close()
        raise TraceError(f"{path}: gzip stream is damaged or truncated ({err}); re-copy or re-capture the "
                         "file") from None
    return _Closing(io.TextIOWrapper(binary, encoding=json.detect_encoding(head), errors="surrogatepass"), raw)


class _Closing:
    """A text reader that also closes the raw file under a gzip reader (GzipFile(fileobj=) leaves it open)."""

    def __init__(self, text: io.TextIOWrapper, raw: io.BufferedIOBase):
        self._text, self._raw = text, raw

    def read(self, size: int = -1) -> str:
        return self._text.read(size)

    def close(self) -> None:
        self._text.close()
        self._raw.close()
