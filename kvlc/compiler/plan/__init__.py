"""The plan passes: a validated spec → expand → resolve → check → build → a frozen, content-hashed Plan."""
