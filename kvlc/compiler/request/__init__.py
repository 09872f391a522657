"""Per request, the hot path: block ids and a token range → checked → descriptor rows or prepared indices."""
