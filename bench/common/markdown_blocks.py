"""Generated blocks inside hand-maintained markdown files, between HTML-comment markers, so a
generator rewrites its block and leaves every hand-written line around it alone."""

from __future__ import annotations


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def read_block(text: str, name: str) -> str | None:
    """The text between the markers of `name` (None when the markers are missing)."""
    start, end = markers(name)
    if start not in text or end not in text:
        return None
    return text.split(start, 1)[1].split(end, 1)[0].strip("\n")


def replace_block(text: str, name: str, block: str) -> str:
    """`text` with the block of `name` replaced; appended at the end when it has no markers."""
    start, end = markers(name)
    wrapped = f"{start}\n{block.strip(chr(10))}\n{end}"
    if start in text and end in text:
        before = text.split(start, 1)[0]
        after = text.split(start, 1)[1].split(end, 1)[1]
        return before + wrapped + after
    return text.rstrip("\n") + "\n\n" + wrapped + "\n"
