"""The key reference (``config_keys_doc``): every key's meaning is its field's whole comment."""

import inspect
import re
import textwrap

import oppo_jax.config.schema as schema
from oppo_jax.config import Config
from oppo_jax.config.docs import field_comments, leaves

# A meaning that ends on one of these was cut mid-sentence.
_DANGLING = re.compile(r"([,;:(|/=+-]|\b(a|an|and|at|by|for|in|of|on|or|the|to|with))$")


def test_a_comment_over_several_lines_is_read_whole():
    source = textwrap.dedent(
        """
        class Section:
            x: int = 1  # trailing
            # first line, cut here
            # and the second line
            y: int = 2
            z: int = 3
        """
    )
    comments = field_comments(source)["Section"]
    assert comments == {"x": "trailing", "y": "first line, cut here and the second line", "z": ""}


def test_every_comment_line_of_the_schema_reaches_the_docs():
    docs = " ".join(doc for *_, doc in leaves(Config))
    lines = inspect.getsource(schema).splitlines()
    inside = [line for line in lines if line.startswith("    #")]  # class bodies only
    assert len(inside) > 10
    for line in inside:
        assert line.strip().removeprefix("#").strip() in docs, line


def test_no_key_doc_ends_mid_sentence_or_quotes_a_measurement():
    for key, _, _, doc in leaves(Config):
        assert len(doc) > 8, f"{key} has no comment"
        assert not _DANGLING.search(doc), f"{key}: {doc!r} ends mid-sentence"
        assert doc.count("(") == doc.count(")"), f"{key}: {doc!r}"
        # measurements belong in BENCHMARKS.md, which a comment may name
        assert not re.search(r"\bvs\b|\d s\b", doc), f"{key}: {doc!r} quotes a measurement"
