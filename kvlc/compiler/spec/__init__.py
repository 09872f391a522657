"""The spec language (``kvlc: 1``): YAML text or a jinja2 template → a frozen, validated :class:`LayoutSpec`.

source (text → data with marks) → validate (data → typed models, every problem located); bounds
checked before any pass; schema describes the language for people and editors."""
