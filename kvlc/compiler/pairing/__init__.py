"""Pairing: two plans and a rank → a compatibility report and a frozen transfer program.

compat (every finding at once) → tp (which producer rank serves which heads) → runs (one tile as
minimal copies) → program (the frozen result)."""
