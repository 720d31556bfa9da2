"""Help texts from docstrings: the docstrings are written in RST for the code's readers; a
terminal shows them without the markup."""

import re

_LITERAL = re.compile(r"``([^`]+)``")


def plain(doc: str) -> str:
    """``doc`` without RST literal markers.

    Example: "``oppo-jax sim``: predicted" -> "oppo-jax sim: predicted".
    """
    return _LITERAL.sub(r"\1", doc)
