"""``python3 -m kvlc.cli``: the kvlc program."""

from kvlc.cli import entry

entry()
