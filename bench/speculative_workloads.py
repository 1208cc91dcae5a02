"""The two workloads of bench/speculative.py, fixed before any run.

* ``repetitive``: answers that copy their input, where prompt lookup drafts well: edit a
  given piece of code and return all of it, or answer with verbatim quotes from a given
  document.
* ``chat``: open-ended questions, whose answers rarely repeat the prompt.
"""

from __future__ import annotations

CODE = '''def parse_config(path):
    """Read a key=value file into a dict, skipping comments and blank lines."""
    config = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            config[key.strip()] = value.strip()
    return config


def merge_configs(base, override):
    """Return a new dict with the keys of override replacing those of base."""
    merged = dict(base)
    for key, value in override.items():
        merged[key] = value
    return merged


def main():
    base = parse_config("base.conf")
    local = parse_config("local.conf")
    config = merge_configs(base, local)
    for key in sorted(config):
        print(key, "=", config[key])
'''

DOCUMENT = """The lighthouse at Cape Morrow was built in 1871 from granite quarried on the island \
itself. Its lamp was first lit with whale oil, then with kerosene from 1885, and it was \
electrified in 1931. The keeper's house, a two-storey brick building beside the tower, was \
home to four families over ninety years. In 1962 the light was automated and the last \
keeper, Thomas Avery, left the island. The tower is 31 metres tall and its light can be \
seen from 22 nautical miles away. Since 1998 the keeper's house has been a museum, open \
from May to September, and the tower can be climbed on Saturdays."""

REPETITIVE = [
    f"Rename the function parse_config to read_config everywhere in this code and return "
    f"the complete updated code, with no explanation:\n\n{CODE}",
    f"Add a docstring line to main() and return the whole file unchanged otherwise:\n\n{CODE}",
    f"Document:\n{DOCUMENT}\n\nQuote, word for word, the sentences of the document that say "
    "when the light was automated and how tall the tower is.",
    f"Document:\n{DOCUMENT}\n\nCopy the document exactly, then add one sentence summarising it.",
]

CHAT = [
    "Write a short story about a fox who learns to paint.",
    "What are three good habits for staying healthy while working from home?",
    "Explain why the sky looks blue during the day and red at sunset.",
    "Give me ideas for a birthday party for a ten-year-old who loves space.",
]

WORKLOADS = {"repetitive": REPETITIVE, "chat": CHAT}
