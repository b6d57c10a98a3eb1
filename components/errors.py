"""Errors a user can cause: the CLI prints the one-line message and exits non-zero (traceback only with --debug)."""


class RecipeError(Exception):
    """A user-facing error; its message names the culprit (config key, file:line, path or value)."""


def read_utf8(path, display: str | None = None) -> str:
    """A user's text file (JSON, JSONL, CSV, YAML, a chat template) as UTF-8; a byte that is not UTF-8 is a
    RecipeError naming the file, line and column instead of a UnicodeDecodeError. OSErrors pass through."""
    from pathlib import Path

    data = Path(path).read_bytes().removeprefix(b"\xef\xbb\xbf")  # a byte-order mark (Excel, Notepad): not text
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise utf8_error(display or str(path), data, e) from None


def utf8_error(where: str, data: bytes, err: UnicodeDecodeError, first_line: int = 1) -> RecipeError:
    """`where:line: not valid UTF-8 (byte 0x.. at column N)` for `data` (starting at line `first_line`)."""
    line = data.count(b"\n", 0, err.start) + first_line
    column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
    return RecipeError(f"{where}:{line}: not valid UTF-8 (byte 0x{data[err.start]:02x} at column {column}); "
                       "save the file as UTF-8")
