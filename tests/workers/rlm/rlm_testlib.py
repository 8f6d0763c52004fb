"""Helpers of the RLM tests (imported by name: pytest puts this directory on sys.path)."""

F = "```"


def block(code: str) -> str:
    """A model turn's fenced ```repl block holding ``code``."""
    return f"{F}repl\n{code}\n{F}"
